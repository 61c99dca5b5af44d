"""The engine's region is every computation by its parameters, not only ``engine(...)``.

[Note: submodule calls outside engine(...)]
Multimodal and prompt-tuning code calls submodules of an engine directly, e.g. the LLaVA
pattern ``embeds = llm.module.get_input_embeddings()(input_ids)`` before ``llm(inputs_embeds=
...)``, or an ``lm_head`` the user applies to hidden states. Such a call computes with the
engine's parameters, so it belongs to the engine's region (see [Note: gradient scale is a
property of the engine's region of the graph] in boundary.py): without boundary nodes its
parameters would see the true gradient instead of f_E times it (gradient_accumulation_steps
times too large, 1/loss_scale too small in fp16), silently.

So every submodule of ``engine.module`` (the root included) carries a forward pre-hook and a
forward hook. A call made while no region of this engine is open (not inside
``engine.forward``, not inside another outside call) opens one: its tensor inputs go through
input boundary nodes and its outputs through output boundary nodes, exactly as for
``engine(...)``; calls nested inside it are part of it. Calls made under ``no_grad`` or during
a backward pass (the recomputation of activation checkpointing, reentrant or not, runs there)
are left alone: no gradient can cross them, or the gradient already crossed the boundary that
was open when the checkpointed forward first ran.

The hooks are registered after ZeRO-3's own forward hooks, so the boundary nodes sit outside
ZeRO-3's gather/release nodes: in backward the prologue runs before ZeRO-3 gathers.

A parameter used directly as a tensor, not through a module call, is not seen by these hooks;
see outside_use.py.

[Note: no hooks inside engine(...)]
Inside ``engine.forward`` the region is already open, so the hooks would only return at once;
but a module with any forward hook leaves torch's fast call path, which on a model of many
small layers costs more than the rest of our per-step work. ``Region.enter_forward`` takes our
two hooks out of every submodule's hook dicts for the duration of ``engine.forward`` (four dict
operations per submodule, no Python frame per call) and ``exit_forward`` puts them back at the
end of the dicts, so they still run after any hook registered since (ZeRO-3's included).
"""
import weakref

import torch

from ..zero.stage3 import counters as stage3_counters
from .boundary import wrap_inputs
from .graph import in_backward



class Region:
    """Which region of one engine is open; owned by the engine (``engine._region``)."""

    __slots__ = ("depth", "_outside_calls", "_handles", "_hooks", "_suspended", "__weakref__")

    def __init__(self):
        self.depth = 0  # > 0 while engine.forward or an outside call runs
        self._outside_calls = []  # stack of (module, ZeRO-3 counter snapshot) for open outside calls
        self._handles = []
        self._hooks = []  # (module, pre-hook id, pre-hook, hook id, hook) per submodule
        self._suspended = 0  # nesting depth of enter_forward (see [Note: no hooks inside engine(...)])

    def install(self, engine) -> None:
        engine_ref = weakref.ref(engine)
        region_ref = weakref.ref(self)
        for module in engine.module.modules():
            pre, post = _make_pre_forward(engine_ref, region_ref), _make_post_forward(engine_ref, region_ref)
            pre_handle = module.register_forward_pre_hook(pre, with_kwargs=True)
            post_handle = module.register_forward_hook(post, with_kwargs=True, always_call=True)
            self._handles += [pre_handle, post_handle]
            self._hooks.append((module, pre_handle.id, pre, post_handle.id, post))

    def enter_forward(self) -> None:
        """engine.forward starts: the region is open, our hooks leave the submodules until it ends."""
        self.depth += 1
        self._suspended += 1
        if self._suspended == 1:
            for module, pre_id, _, post_id, _ in self._hooks:
                hooks = module.__dict__
                hooks["_forward_pre_hooks"].pop(pre_id, None)
                hooks["_forward_hooks"].pop(post_id, None)

    def exit_forward(self) -> None:
        self.depth -= 1
        self._suspended -= 1
        if self._suspended == 0:  # (after remove() there is nothing to put back)
            for module, pre_id, pre, post_id, post in self._hooks:
                hooks = module.__dict__
                hooks["_forward_pre_hooks"][pre_id] = pre
                hooks["_forward_hooks"][post_id] = post

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooks.clear()


def _make_pre_forward(engine_ref, region_ref):

    def _pre_forward_outside_call(module, args, kwargs):
        region = region_ref()
        if region is None or region.depth or not torch.is_grad_enabled() or in_backward():
            return None
        engine = engine_ref()
        region.depth += 1
        zero3 = engine.zero_optimization_stage() == 3
        region._outside_calls.append((module, stage3_counters.snapshot(module) if zero3 else None))
        engine._recover_from_failed_backward()
        return wrap_inputs(engine, args, kwargs)

    return _pre_forward_outside_call


def _make_post_forward(engine_ref, region_ref):

    def _post_forward_outside_call(module, args, kwargs, output):
        region = region_ref()
        if region is None or not region._outside_calls or region._outside_calls[-1][0] is not module:
            return None
        _, before = region._outside_calls.pop()
        region.depth -= 1
        if output is None:  # always_call: the forward raised; the region is closed, nothing to wrap
            return None
        engine = engine_ref()
        return engine._wrap_forward_outputs(module, output, before)

    return _post_forward_outside_call
