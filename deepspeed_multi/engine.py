"""MultiEngine: a DeepSpeedEngine whose backward prologue and epilogue run from autograd hooks.

The engine stays thin: the boundary nodes live in ``_boundary``, the gradient scale in
``grad_scale``, the ZeRO gradient-buffer handling in ``zero_buffers``.
"""
import logging
import os
from contextlib import contextmanager

import deepspeed.comm as dist
import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

from . import fused_zero, grad_scale, zero3_counters, zero_buffers
from ._boundary import wrap_inputs, wrap_outputs
from ._state import TrainingState
from .config import MultiOptions
from .skip_group import SkipGroup

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _any_param_in_current_graph(params) -> bool:
    """Will the running backward accumulate into any of ``params``? Stops at the first one."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc
    with torch.enable_grad():  # leaf parameters need grad mode to hand out their AccumulateGrad
        for param in params:
            if not param.requires_grad:
                continue
            node = _get_grad_fn_or_grad_acc(param)
            if node is not None and torch._C._will_engine_execute_node(node):
                return True
    return False


class _ForwardRecord:
    """Handed from one forward to the backward passes through its outputs."""
    __slots__ = ("graph_tasks", "zero3_armed")

    def __init__(self, zero3_armed=None):
        self.graph_tasks = set()  # autograd graph tasks (backward passes) that reached these outputs
        self.zero3_armed = zero3_armed or {}


class MultiEngine(DeepSpeedEngine):
    """Drop-in DeepSpeedEngine for plain ``loss.backward()`` through any number of engines.

    Build it with :func:`deepspeed_multi.initialize`. Gradients accumulate over backward calls
    until :meth:`step` (at the end of the engine's ``gradient_accumulation_steps`` window) or
    :meth:`zero_grad`, as with a plain ``nn.Module``.
    """

    def __init__(self, *args, user_managed_boundary=False, options=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = options or MultiOptions()
        # Every stage gets the torch-style path from our boundary nodes, not from DeepSpeed's
        # output hooks and per-parameter counters, so stage 0 and frozen engines work too.
        self._support_torch_style_backward = True
        if isinstance(self.optimizer, ZeROOptimizer):
            # The epilogue runs from our own graph-task callback (see _boundary).
            self.optimizer.unregister_grad_acc_post_hooks()
        self._state = TrainingState.IDLE
        # Micro-steps since the last update. DeepSpeed runs unmanaged (every super().step()
        # updates); this engine keeps DeepSpeed's managed meaning of gradient_accumulation_steps
        # unless the user configured managed_gradient_accumulation=false.
        self._user_managed_boundary = user_managed_boundary
        self._window_micro_steps = 0
        self._window_backwards = 0
        # One tiny all-reduce per update at ZeRO 0/1; DSM_CHECK_RANK_AGREEMENT=0 turns it off.
        self.check_rank_agreement = os.environ.get("DSM_CHECK_RANK_AGREEMENT", "1") != "0"
        self._trainable_params = [p for p in self.module.parameters() if p.requires_grad]
        zero_buffers.start_window(self.optimizer)
        if self.options.fused_reduce:
            fused_zero.install(self.optimizer)
        self.skip_group = None
        if self.options.skip_group is not None and self.trains:
            self.skip_group = SkipGroup.named(self.options.skip_group)
            self.skip_group.add(self)

    # ---------------------------------------------------------------- forward
    def forward(self, *inputs, **kwargs):
        self._recover_from_failed_backward()
        inputs, kwargs = wrap_inputs(self, inputs, kwargs)
        if self.zero_optimization_stage() != 3 or not torch.is_grad_enabled():
            return wrap_outputs(self, super().forward(*inputs, **kwargs), _ForwardRecord())
        before = zero3_counters.snapshot(self.module)
        outputs = super().forward(*inputs, **kwargs)
        return wrap_outputs(self, outputs, _ForwardRecord(zero3_counters.armed_by_forward(before, self.module)))

    # DeepSpeed's own output hooks (registered by DeepSpeedEngine.forward) call these two;
    # the boundary nodes replace them, so they do nothing here.
    def _backward_prologue(self):
        pass

    def _backward_prologue_per_tensor(self, grad):
        return grad

    # ---------------------------------------------------------------- backward hooks
    @property
    def has_optimizer(self) -> bool:
        # ZeRO-3 without an optimizer still gets a DeepSpeedZeRoOffload (parameter management only).
        return self.optimizer is not None and not isinstance(self.optimizer, DeepSpeedZeRoOffload)

    @property
    def trains(self) -> bool:
        """True when this engine has an optimizer and parameters that require grad."""
        return self.has_optimizer and bool(self._trainable_params)

    def grad_scale_factor(self) -> float:
        return grad_scale.factor(self)

    def _before_output_backward(self, record, create_graph: bool):
        """A gradient reached an output of one forward: re-arm ZeRO-3 when it is a later backward pass."""
        task = torch._C._current_graph_task_id()
        first_in_task = task not in record.graph_tasks
        record.graph_tasks.add(task)
        if self.zero_optimization_stage() != 3:
            return
        if first_in_task and len(record.graph_tasks) > 1:
            zero3_counters.rearm(record.zero3_armed)
        if create_graph:
            raise RuntimeError(
                f"MultiEngine ({self._engine_name()}, ZeRO stage 3): backward with create_graph=True (double "
                "backward, e.g. a gradient penalty from torch.autograd.grad) is not supported; ZeRO-3 partitions "
                "the parameters that the double backward needs as soon as the first backward leaves them. Use "
                "ZeRO stage <= 2 for this engine.")

    def _engine_name(self) -> str:
        return type(self.module).__name__

    def _pre_backward(self):
        """First gradient reached this engine in a backward pass: run the prologue once."""
        if self._state is TrainingState.IN_BACKWARD or not self.trains:
            return
        if not _any_param_in_current_graph(self._trainable_params):
            # e.g. torch.autograd.grad(loss, inputs) or a backward that stops above the params.
            return
        self._state = TrainingState.IN_BACKWARD
        self._window_backwards += 1
        if isinstance(self.optimizer, ZeROOptimizer):
            self.optimizer.clear_backward_seen_flag()
        DeepSpeedEngine._backward_prologue(self)
        if not self.managed_gradient_accumulation():
            self._unmanaged_backward_count += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)

    def _post_backward(self):
        """End of the graph task: bucket flush, reduction, fp32 accumulation."""
        try:
            DeepSpeedEngine._backward_epilogue(self)
        finally:
            self._state = TrainingState.GRADS_READY

    def _recover_from_failed_backward(self):
        """Called from forward() and zero_grad(): clean up after a backward that raised part way."""
        if self._state is TrainingState.IN_BACKWARD and not _in_backward():
            logger.warning("deepspeed_multi: a backward pass through this engine raised before it finished; "
                           "its partial gradients are discarded.")
            zero_buffers.abort_backward(self)
            self._window_backwards = 0
            self._state = TrainingState.IDLE

    # ---------------------------------------------------------------- user API
    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Old single-engine API: same as ``loss.backward()``; returns ``loss / gas`` like DeepSpeed.

        The 1/gas scale is applied at the engine boundary, so ``scale_wrt_gas=False`` is refused
        rather than silently ignored.
        """
        if not scale_wrt_gas:
            raise ValueError("MultiEngine.backward(scale_wrt_gas=False) is not supported: the engine divides by "
                             "gradient_accumulation_steps at its boundary. Call loss.backward() on a loss you "
                             "have multiplied by gradient_accumulation_steps instead.")
        loss.backward(retain_graph=retain_graph)
        return loss / self.gradient_accumulation_steps()

    def scale(self, loss):
        """Kept for old code: the boundary applies the loss scale, so this returns ``loss`` unchanged."""
        return loss

    def _check_can_step(self, what):
        if self._state is TrainingState.IN_BACKWARD:
            if _in_backward():
                raise RuntimeError(f"{what} called while a backward pass is still producing this engine's "
                                   "gradients; call it after loss.backward() returns.")
            raise RuntimeError(f"{what} called after a backward pass through this engine failed part way; "
                               "call engine.zero_grad() to discard its partial gradients, then run it again.")

    def is_update_boundary(self) -> bool:
        """True when the next step() applies an update (end of the gradient-accumulation window)."""
        if self._user_managed_boundary:
            return True
        return (self._window_micro_steps + 1) % self.gradient_accumulation_steps() == 0

    @contextmanager
    def no_sync(self):
        """Accepted at every stage; gradients stay exactly right inside it.

        Gradients are already reduced only at the update for stages 0 and 1 (see [Note: who owns
        the gradient-accumulation boundary] in config.py), so this is DeepSpeed's no_sync there.
        Stages 2 and 3 must reduce-scatter during each backward to partition gradients; inside
        this context they still do (it saves nothing, but nothing is lost either).
        """
        if self.zero_optimization_partition_gradients():
            yield
        else:
            with super().no_sync():
                yield

    def _check_ranks_agree(self):
        """Every rank must have run the same number of backward passes through this engine.

        A backward that reaches an engine on some ranks only leaves its collectives unmatched;
        ZeRO-0/1 reduce at the update, so they are caught here before the mismatch. ZeRO-2/3
        reduce during backward: a mismatch there blocks in that collective before any rank gets
        here (until the process-group timeout of deepspeed.init_distributed), so the check,
        one all-reduce and a host sync per update, is not run for them.
        """
        counts = torch.tensor([self._window_backwards, -self._window_backwards], dtype=torch.int64,
                              device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        high, low = counts[0].item(), -counts[1].item()
        if high != low:
            raise RuntimeError(
                f"MultiEngine ({self._engine_name()}): ranks disagree on how many backward passes reached this "
                f"engine since its last update (between {low} and {high}; this rank: {self._window_backwards}). "
                "Every rank must use the engine's outputs in the loss it backpropagates (multiply by 0 to keep "
                "an output in the graph on ranks that do not need it).")

    def step(self, lr_kwargs=None):
        if not self.has_optimizer:
            raise RuntimeError(f"MultiEngine ({self._engine_name()}) is inference-only: it was built without an "
                               "optimizer, so step() has nothing to update. Pass optimizer=... (or an \"optimizer\" "
                               "config section) to deepspeed_multi.initialize to train it.")
        self._check_can_step("step()")
        if not self.is_update_boundary():
            self._window_micro_steps += 1
            self.micro_steps += 1
            return
        self._window_micro_steps = 0
        if self.trains and self.check_rank_agreement and not self.zero_optimization_partition_gradients():
            self._check_ranks_agree()
        self._window_backwards = 0
        if self.skip_group is not None:
            skip = self.skip_group.should_skip(self)
            self._updates_done += 1
            self._nonfinite.zero_()
            if skip:
                self._skip_update()
                return
        super().step(lr_kwargs)
        zero_buffers.start_window(self.optimizer)
        self._state = TrainingState.IDLE

    def _skip_update(self):
        """Drop this window's gradients without updating, as DeepSpeed does on an fp16 overflow."""
        if self.fp16_enabled():
            self.optimizer._update_scale(True)
        self.zero_grad()
        self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.micro_steps += 1
        self._step_applied = False

    def zero_grad(self):
        """Discard every gradient accumulated since the last step, like ``nn.Module.zero_grad``."""
        if self._state is TrainingState.IN_BACKWARD and _in_backward():
            raise RuntimeError("zero_grad() called while a backward pass is producing this engine's gradients.")
        self._recover_from_failed_backward()
        super().zero_grad()
        zero_buffers.discard(self.optimizer)
        if self.skip_group is not None:
            self._nonfinite.zero_()
        self._window_backwards = 0
        self._state = TrainingState.IDLE
