"""0-dim parameters (a learned scalar: a temperature, a noise scale) through DeepSpeed's engine construction.

[Note: 0-dim parameters in DeepSpeed's broadcast]
DeepSpeed sends a parameter from rank 0 as bytes, ``p.data.view(torch.uint8)``: in the engine's
start-up broadcast of every replicated parameter (``_broadcast_model``, ZeRO 0-2) and in ZeRO-3's
conversion of each parameter (``Init._zero_init_param``). torch cannot view a 0-dim tensor as
another element size, so an engine over a model with a 0-dim parameter fails at construction
("self.dim() cannot be 0 to view BFloat16 as Byte"): at ZeRO 0-2 in 16 bits, at ZeRO-3 in every
dtype, upstream too. For those two calls alone, a 0-dim parameter's data is its 1-element view (the
same storage), so the bytes rank 0 sends land in the parameter itself; it is 0-dim again as the call
returns, and a ZeRO-3 parameter records the 0-dim shape its gathers restore (``ds_shape``).
"""
import contextlib

import torch


@contextlib.contextmanager
def broadcastable(module):
    """Every 0-dim parameter of ``module`` 1-dim (a view of its own storage) inside the block."""
    scalars = [p for p in module.parameters() if p.dim() == 0]
    for p in scalars:
        p.data = p.data.view(1)
    try:
        yield
    finally:
        for p in scalars:
            p.data = p.data.view(())


def zero3_init_param(original):
    """ZeRO-3's ``Init._zero_init_param`` taking a 0-dim parameter too (see the Note)."""

    def _zero_init_param(self, param):
        if param.dim() != 0:
            return original(self, param)
        param.data = param.data.view(1)
        original(self, param)
        param.ds_shape = torch.Size([])
        if param.numel() == 1:  # kept whole (persistent); a partitioned one holds an empty tensor
            param.data = param.data.view(())

    return _zero_init_param
