"""``zero_grad()`` on a model that holds engines reaches the engines.

[Note: zero_grad() on a model that holds an engine]
Lightning programs clear gradients through the model as often as through the optimizer
(``netD.zero_grad()`` in Fabric's DCGAN example, ``self.zero_grad()`` in a LightningModule).
That is ``nn.Module.zero_grad``, which sets each parameter's ``.grad`` to None; a ZeRO-2/3 engine
keeps its gradients in its partitions, so they would survive and the next update would add them:
silently not DDP's update. So the object the user holds gets a ``zero_grad`` of its own (an
instance attribute, which Python looks up before the class's method) that first calls
``engine.zero_grad()`` for each trained engine it holds, then ``nn.Module.zero_grad`` for the
rest. For a LightningModule the strategy sets it when it builds the engines. For Fabric the
object is the ``_FabricModule`` that ``fabric.setup`` builds around the engine after the
strategy returns it; a module-registration hook (torch's global one) sees the engine being
registered as that wrapper's submodule and sets it there; the hook acts once.
"""
import functools

import torch
from torch.nn.modules.module import register_module_module_registration_hook


def _zero_grad(owner, engines, set_to_none=True):
    for engine in engines:
        if engine.has_optimizer:
            engine.zero_grad()
    torch.nn.Module.zero_grad(owner, set_to_none)


def route(owner, engines) -> None:
    """``owner.zero_grad()`` clears ``engines``' gradients too (see the Note)."""
    owner.__dict__["zero_grad"] = functools.partial(_zero_grad, owner, list(engines))


def unroute(owner) -> None:
    owner.__dict__.pop("zero_grad", None)


class WrapperWatch:
    """Routes ``zero_grad`` of the module that next registers a watched engine as its submodule."""

    def __init__(self):
        self._handles = []

    def watch(self, engine) -> None:
        self.close()   # earlier watches have fired: fabric.setup wraps before it returns
        fired = []

        def hook(parent, name, submodule):
            if submodule is engine and not fired:
                fired.append(True)
                route(parent, [engine])
        self._handles.append(register_module_module_registration_hook(hook))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
