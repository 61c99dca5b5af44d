"""MultiEngine: a DeepSpeedEngine whose backward prologue and epilogue run from autograd hooks.

The engine stays thin and owns the state; the layers beside it do the work: the autograd
boundary (``autograd/``), what changes in DeepSpeed's ZeRO optimizers (``zero/``, through
``compat``), and the checks that fail loudly instead of hanging (``reliability/``).
docs/design.md walks one ``loss.backward()`` through two engines.
"""
import logging
from contextlib import contextmanager

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import DummyOptim
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

from . import compat, hand_back, user_boundary, zero
from .autograd import grad_scale, graph, outside_use
from .autograd.boundary import wrap_inputs, wrap_outputs
from .autograd.region import Region
from .autograd.tree import tree_tensors
from .config import MultiOptions
from .reliability import dp_groups, managed_path, misuse, update_paths, watchdog
from .reliability.rank_agreement import RankAgreement
from .reliability.skip_group import SkipGroup
from .state import TrainingState
from .switches import CHECK_RANK_AGREEMENT, switch_on
from .zero import buffers, zero_dim
from .zero.stage12 import bucket_pack as stage12_bucket_pack
from .zero.stage3 import counters as stage3_counters
from .zero.stage3 import generation as stage3_generation
from .zero.stage3 import prefetch as stage3_prefetch
from .zero.stage3 import release_between as stage3_release_between

logger = logging.getLogger(__name__)


class _ForwardRecord:
    """Handed from one forward to the backward passes through its outputs."""
    __slots__ = ("graph_tasks", "zero3_armed")

    def __init__(self, zero3_armed=None):
        self.graph_tasks = set()  # autograd graph tasks (backward passes) that reached these outputs
        self.zero3_armed = zero3_armed or {}


class MultiEngine(DeepSpeedEngine):
    """Drop-in DeepSpeedEngine for plain ``loss.backward()`` through any number of engines.

    Build it with :func:`deepspeed_multi.initialize`. Gradients accumulate over backward calls until
    :meth:`step` (at the end of its ``gradient_accumulation_steps`` window) or :meth:`zero_grad`.
    """

    def __init__(self, *args, user_managed_boundary=False, options=None, **kwargs):
        compat.check_deepspeed()
        super().__init__(*args, **kwargs)
        self.options = options or MultiOptions()
        # Our boundary nodes drive every stage (not DeepSpeed's output hooks), so stage 0 and frozen engines work.
        self._support_torch_style_backward = True
        if isinstance(self.optimizer, ZeROOptimizer):
            # The epilogue runs from our own graph-task callback (see autograd/boundary.py).
            self.optimizer.unregister_grad_acc_post_hooks()
        self._state = TrainingState.IDLE
        # State the layers beside the engine keep on it, declared here (set by their install()).
        self._mixed_use = None  # outside_use.MixedUseCheck while direct uses are checked
        self._outside_use_hooks = None  # outside_use: gradient-accumulator pre-hooks (ZeRO-0)
        self._nonfinite = self._skip_watch = None  # skip_group: non-finite flag, gradient watches
        self._skip_decisions, self._updates_done = {}, 0  # skip_group: round -> decision, rounds
        self._dsm_dp_ranks = None  # dp_groups: the ranks this engine averages over
        self._dsm_autotp_block = None  # dp_groups: AutoTP's tensor-parallel block size, on DeepSpeed's groups
        # Micro-steps since the last update. DeepSpeed runs unmanaged (every super().step()
        # updates); this engine keeps DeepSpeed's managed meaning of gradient_accumulation_steps
        # unless the user configured managed_gradient_accumulation=false.
        self._user_managed_boundary = user_managed_boundary
        self._config_managed = not user_managed_boundary  # as configured (the Trainer's caller may own it later)
        self._caller_scales_loss = False  # the caller divides the loss itself (integrations/engine_steps.py)
        self._window_micro_steps = self._window_backwards = 0
        # One tiny all-reduce per update at ZeRO 0/1, off the critical path (rank_agreement.py); 0 turns it off.
        self.check_rank_agreement = switch_on(CHECK_RANK_AGREEMENT)
        self._rank_agreement = RankAgreement(self)
        self._trainable_params = [p for p in self.module.parameters() if p.requires_grad]
        # The region: engine(...) and every call of a submodule made outside it (autograd/region.py);
        # gradients that reach a parameter without crossing it raise (autograd/outside_use.py).
        self._region = Region()
        self._region.install(self)
        self._boundary_crossed = False
        self._leftovers_task = None
        outside_use.install(self)
        buffers.start_window(self.optimizer)
        zero.install(self.optimizer, self.options)  # the fast paths ([Note: the install order])
        # The rank-agreement wait goes after the bucket pack, right before the first collective.
        self._agreement_in_pack = stage12_bucket_pack.run_before_reduction(self.optimizer, self._rank_agreement.finish)
        self.skip_group = None
        if self.options.skip_group is not None and self.trains:
            self.skip_group = SkipGroup.named(self.options.skip_group)
            self.skip_group.add(self)
        self.watchdog = watchdog.attach(self)  # marks this engine's collective regions (watchdog.py)
        misuse.install_outer_engine_guard(self)  # deepspeed.initialize(model=<this engine>)
        misuse.claim_parameters(self)  # a second trainable engine over them waits for destroy()
        dp_groups.register_dp_group(self)  # checked where a backward pass first reaches an engine

    # ---------------------------------------------------------------- forward
    def forward(self, *inputs, **kwargs):
        """``DeepSpeedEngine.forward`` with boundary nodes on the inputs and outputs, where a plain
        ``loss.backward()`` runs DeepSpeed's backward prologue and epilogue. Refused after :meth:`destroy`."""
        misuse.refuse_if_destroyed(self, "forward()")
        self._recover_from_failed_backward()
        inputs, kwargs = wrap_inputs(self, inputs, kwargs)
        stage3 = self.zero_optimization_stage() == 3
        before = stage3_counters.snapshot(self.module) if stage3 and torch.is_grad_enabled() else None
        stage3_release_between.forward_starts(self)  # [Note: an engine's parameters while other engines run]
        self._region.enter_forward()
        try:
            outputs = super().forward(*inputs, **kwargs)
        finally:
            self._region.exit_forward()
        if stage3 and (not self.trains or not any(t.requires_grad for t in tree_tensors(outputs))):
            stage3_prefetch.drain(self)  # [Note: draining ZeRO-3's prefetch]: no step() or backward will
        return self._wrap_forward_outputs(self.module, outputs, before)

    def _wrap_forward_outputs(self, module, outputs, zero3_before):
        """Output boundary nodes for one forward of ``module`` (this engine's module, or a submodule
        called outside engine(...)); ``zero3_before`` is its ZeRO-3 counter snapshot, or None."""
        if zero3_before is None:
            outputs = wrap_outputs(self, outputs, _ForwardRecord())
            if self._mixed_use is not None and torch.is_grad_enabled():
                self._mixed_use.watch_region(outputs)  # first updates only (outside_use.MixedUseCheck)
            return outputs
        outputs = stage3_counters.cover_outputs(module, outputs)
        return wrap_outputs(self, outputs, _ForwardRecord(stage3_counters.armed_by_forward(zero3_before, module)))

    def _broadcast_model(self):
        with zero_dim.broadcastable(self.module):  # [Note: 0-dim parameters in DeepSpeed's broadcast]
            super()._broadcast_model()

    # DeepSpeed's output hooks (DeepSpeedEngine.forward) call these two; the boundary nodes replace them.
    def _backward_prologue(self):
        pass

    def _backward_prologue_per_tensor(self, grad):
        return grad

    # ---------------------------------------------------------------- backward hooks
    @property
    def has_optimizer(self) -> bool:
        """True when the engine was built with an optimizer (a ZeRO-3 engine without one is frozen)."""
        # No optimizer: ZeRO-3 gets a DeepSpeedZeRoOffload, bf16 at stage 0 a BF16_Optimizer over a DummyOptim.
        return self.optimizer is not None and not isinstance(self.optimizer, DeepSpeedZeRoOffload) \
            and not isinstance(getattr(self.optimizer, "optimizer", None), DummyOptim)

    @property
    def trains(self) -> bool:
        """True when this engine has an optimizer and parameters that require grad."""
        return self.has_optimizer and bool(self._trainable_params)

    def grad_scale_factor(self) -> float:
        """The factor the engine applies to the gradient entering its outputs.

        Returns:
            float: 1/``gradient_accumulation_steps`` (1 where the caller divides the loss itself: the
            Trainer, Lightning), times the fp16 loss scale where the engine scales the loss.
        """
        return grad_scale.factor(self)

    def _before_output_backward(self, record, create_graph: bool):
        """A gradient reached an output of one forward: re-arm ZeRO-3 when it is a later backward pass."""
        task = graph.current_task()
        managed_path.reached(self)  # [Note: the drop-in rule]: refused beside an engine on DeepSpeed's managed path
        first_in_task = task not in record.graph_tasks
        record.graph_tasks.add(task)
        if self.zero_optimization_stage() != 3:
            return
        if first_in_task and len(record.graph_tasks) > 1:
            stage3_counters.rearm(record.zero3_armed)
        if not self.trains and self._leftovers_task != task:  # a frozen engine runs no optimizer epilogue
            self._leftovers_task = task
            graph.at_end_of_backward(lambda: stage3_prefetch.after_frozen_backward(self))
        if create_graph:
            misuse.refuse_double_backward_at_zero3(self)

    def _engine_name(self) -> str:
        return getattr(self, "_part_name", None) or type(self.module).__name__  # (parts/build.py names parts)

    def _pre_backward(self):
        """First gradient reached this engine in a backward pass: run the prologue once."""
        self.watchdog.backward_reached()
        if self._state is TrainingState.IN_BACKWARD or not self.trains:
            return
        if not graph.any_param_in_current_graph(self._trainable_params):
            # torch.autograd.grad(loss, inputs), or reentrant checkpointing's nested pass (autograd/outside_use.py).
            if not self._boundary_crossed:
                self._boundary_crossed = True
                graph.at_end_of_backward(self._close_boundary_crossing)
            return
        self._start_backward()

    def _close_boundary_crossing(self):
        self._boundary_crossed = False
        if self._state is TrainingState.IN_BACKWARD:  # started by a nested (reentrant) pass of this one
            self._post_backward()

    def _start_backward(self):
        """Run the prologue for this backward pass and queue the epilogue at its end."""
        self._state = TrainingState.IN_BACKWARD
        self._window_backwards += 1
        if isinstance(self.optimizer, ZeROOptimizer):
            self.optimizer.clear_backward_seen_flag()
        DeepSpeedEngine._backward_prologue(self)
        if not self.managed_gradient_accumulation():
            self._unmanaged_backward_count += 1
        if not self._boundary_crossed:  # a nested pass: the epilogue waits for the outer pass's end
            graph.at_end_of_backward(self._post_backward)

    def _post_backward(self):
        """End of the graph task: bucket flush, reduction, fp32 accumulation."""
        try:
            DeepSpeedEngine._backward_epilogue(self)
        finally:
            self._state = TrainingState.GRADS_READY
            self.watchdog.leave("backward")
            if self._mixed_use is not None:
                self._mixed_use.end_backward()

    def _recover_from_failed_backward(self):
        """Called from forward() and zero_grad(): clean up after a backward that raised part way."""
        if not graph.in_backward():
            self._boundary_crossed = False
        if self._state is TrainingState.IN_BACKWARD and not graph.in_backward():
            logger.warning("deepspeed_multi: a backward pass through this engine raised before it finished; "
                           "its partial gradients are discarded.")
            buffers.abort_backward(self)
            self._window_backwards = 0
            self._state = TrainingState.IDLE

    # ---------------------------------------------------------------- user API
    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Upstream's ``engine.backward``: the loss scaled as upstream scales it, then one backward through every
        engine it reaches ([Note: a loss scaled by engine.backward]).

        Args:
            loss (torch.Tensor): the scalar to backpropagate.
            retain_graph (bool): passed to ``loss.backward``.
            scale_wrt_gas (bool): divide by ``gradient_accumulation_steps`` (False: the caller divided the loss,
                as the Trainer does).

        Returns:
            torch.Tensor: ``loss / gradient_accumulation_steps`` (``loss`` with ``scale_wrt_gas=False``), as upstream.

        Raises:
            RuntimeError: the same ``loss`` was backpropagated through ``engine.backward`` before.
        """
        misuse.check_not_backpropagated(self, loss)
        gas_scaled, scaled, ambient = grad_scale.scale_loss(self, loss, scale_wrt_gas)
        with grad_scale.backward_of(self, ambient, scale_wrt_gas):
            scaled.backward(retain_graph=retain_graph)
        misuse.mark_backpropagated(self, loss)
        return gas_scaled

    def scale(self, loss):
        """Kept for old code: the boundary applies the loss scale.

        Args:
            loss (torch.Tensor): the loss.

        Returns:
            torch.Tensor: ``loss``, unchanged.
        """
        return loss

    def is_update_boundary(self) -> bool:
        """Whether the next :meth:`step` applies an update.

        Returns:
            bool: True at the end of the engine's ``gradient_accumulation_steps`` window, or where the caller
            set the boundary (:meth:`set_gradient_accumulation_boundary`, the Trainer, Lightning).
        """
        return user_boundary.is_update_boundary(self)

    def generation_mode(self):
        """The module over whole parameters, for generation between updates (ZeRO-3).

        Every parameter gathered once, ZeRO-3's hooks off, under ``torch.no_grad()``; partitioned again at the
        exit. A collective of the engine's group; pending gradients stay untouched (docs/generation.md).

        Returns:
            A context manager whose ``__enter__`` gives the module. At stages 0-2 it only runs the module
            under ``torch.no_grad()``.
        """
        return stage3_generation.generation_mode(self)

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Set whether the next :meth:`step` updates (DeepSpeed's API; [Note: a boundary set by the caller]).

        Args:
            is_boundary (bool): True: the next ``step()`` updates, whatever the window's count.
        """
        user_boundary.set_boundary(self, is_boundary)  # [Note: a boundary set by the caller]

    @contextmanager
    def no_sync(self):
        """DeepSpeed's ``no_sync``, accepted at every stage; gradients stay exactly right inside it.

        Stages 0/1 reduce only at the update: DeepSpeed's no_sync there. Stages 2/3 must reduce-scatter
        in each backward; inside it they still do (saves nothing)."""
        if self.zero_optimization_partition_gradients():
            yield
        else:
            with super().no_sync():
                yield

    def allreduce_gradients(self, *args, **kwargs):
        """DeepSpeed's reduction at ZeRO-0/1, on the engine's own data-parallel group, at the update only."""
        if not self._agreement_in_pack:
            self._rank_agreement.finish()  # before the first gradient collective (rank_agreement.py)
        with dp_groups.own_dp_group(self), user_boundary.reduction(self) as reduce:  # (ZeRO-0: own group)
            if reduce:
                super().allreduce_gradients(*args, **kwargs)

    @watchdog.watched("step")
    def step(self, lr_kwargs=None):
        """End one micro-step; at the update boundary, reduce (ZeRO-0/1), clip and update, as DeepSpeed.

        Off the boundary only the micro-step counters advance; a window no backward reached advances the
        counters and the LR schedule only ([Note: step() with no gradients]).

        Args:
            lr_kwargs (dict, optional): passed to the LR scheduler's ``step``, as DeepSpeed's.

        Raises:
            RuntimeError: the engine has no optimizer, was destroyed, is inside a backward pass, or a
                backward through it failed part way (call :meth:`zero_grad` first).
        """
        if not self.has_optimizer:
            raise RuntimeError(f"MultiEngine ({self._engine_name()}) is inference-only: it was built without an "
                               "optimizer, so step() has nothing to update. Pass optimizer=... (or an \"optimizer\" "
                               "config section) to deepspeed_multi.initialize to train it.")
        misuse.refuse_step_now(self)
        stage3_prefetch.drain(self)
        if not self.is_update_boundary():
            self._window_micro_steps += 1
            self.micro_steps += 1
            self._step_applied = False  # was_step_applied(): as DeepSpeed's step() off the boundary
            return
        self._window_micro_steps = 0
        if self._mixed_use is not None:
            self._mixed_use.after_update()
            if not self._mixed_use.active:
                self._mixed_use = None
        misuse.check_requires_grad_unchanged(self)
        if self.trains and self.check_rank_agreement and not self.zero_optimization_partition_gradients():
            self._rank_agreement.start(self._window_backwards)  # finished before the first collective
        accumulated = self._window_backwards > 0
        self._window_backwards = 0
        if self.skip_group is not None:
            self._rank_agreement.finish()
            skip = self.skip_group.should_skip(self)
            self._updates_done += 1
            self._nonfinite.zero_()
            if skip:
                update_paths.skip_update(self)
                return
        if not accumulated:
            self._rank_agreement.finish()  # decide this path together with the other ranks
            update_paths.step_without_gradients(self, lr_kwargs)
            return
        try:
            update_paths.count_samples_as_upstream(self)
            super().step(lr_kwargs)
            self._rank_agreement.finish()  # (no-op: DeepSpeed's reduction finished it)
            grad_scale.back_off_after_overflow(self)  # [Note: torch_autocast's GradScaler]
        except BaseException:
            update_paths.abort_step(self)
            raise
        buffers.start_window(self.optimizer)
        self._state = TrainingState.IDLE

    __del__ = hand_back.at_garbage_collection  # DeepSpeed's destroy() only: GC comes at any point

    def destroy(self):
        """DeepSpeed's destroy() after the module is handed back (hand_back.py); later uses are refused."""
        if self._state is not TrainingState.DESTROYED:
            misuse.refuse_inside_backward(self, "destroy()")
            self._recover_from_failed_backward()  # (a backward that raised: its partial gradients go)
            hand_back.hand_back(self)
            super().destroy()
            self._state = TrainingState.DESTROYED

    def zero_grad(self):
        """Discard every gradient accumulated since the last step, like ``nn.Module.zero_grad``."""
        misuse.refuse_if_destroyed(self, "zero_grad()")
        misuse.refuse_inside_backward(self, "zero_grad()")
        self._recover_from_failed_backward()
        stage3_prefetch.drain(self)
        super().zero_grad()
        buffers.discard(self.optimizer)
        if self.skip_group is not None:
            self._nonfinite.zero_()
        self._window_backwards = 0
        self._state = TrainingState.IDLE
