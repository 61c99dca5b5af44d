"""ZeRO-1/2 with ``round_robin_gradients``: each parameter linked to its own slice of the fp32 master.

[Note: round-robin fp32 links]
``round_robin_gradients`` reorders each parameter group before it is flattened (parameter k to
rank k mod the world size, ``round_robin_bit16_groups``), so the flat buffer, its partitions and
the fp32 master hold the parameters in that order. DeepSpeed then links every parameter to its
fragment of the master (``_hp_mapping``, in ``_link_all_hp_params``) walking the groups in their
original order, with offsets counted along that order unless the layout has alignment padding
(0.19.8 passes the real offsets then; 0.19.4 never does). Without padding every parameter is
linked to another one's slice. Training does not read the links, so the update is right; what
reads them is wrong, upstream too: ``safe_get_full_fp32_param`` / ``_grad`` /
``_optimizer_state`` and their setters, and the universal checkpoint's slice map
(``_param_slice_mappings``). Measured on 0.19.8, one ZeRO-1 bf16 engine of three Linear layers, 2
ranks: the fp32 value read for a parameter was another parameter's, up to 1.93 from its own.

So the links are made over the groups in the order their flat buffers hold them (DeepSpeed's own
method, given ``round_robin_bit16_groups`` as the groups while it runs; offsets it computes
itself are looked up by parameter, so they stay right), at initialize and whenever DeepSpeed
links again (checkpoint loads, ``zero/master_alias.py``), and the slice map is rebuilt from them.
A correctness fix, installed on every supported release.
"""
from __future__ import annotations

from ... import compat

FEATURE = "stage12_round_robin_links"
_LINK = "_link_all_hp_params"


def applies(optimizer) -> bool:
    """A ZeRO-1/2 optimizer whose flat buffers hold some group in another order than ``bit16_groups``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not getattr(optimizer, "round_robin_gradients", False):
        return False
    laid_out = getattr(optimizer, "round_robin_bit16_groups", None)
    return laid_out is not None and any([id(p) for p in a] != [id(p) for p in b]
                                        for a, b in zip(laid_out, optimizer.bit16_groups))


def link_all_hp_params(self):
    """DeepSpeed's ``_link_all_hp_params`` over the groups in their flat buffers' order (see the Note)."""
    given = self.bit16_groups
    self.bit16_groups = self.round_robin_bit16_groups
    try:
        compat.original(self, _LINK)()
    finally:
        self.bit16_groups = given


def install(optimizer) -> bool:
    """Link the parameters to their own fp32 slices again, now and at every later link; return whether needed."""
    if not applies(optimizer):
        return False
    compat.replace_method(optimizer, _LINK, link_all_hp_params, FEATURE)
    optimizer._link_all_hp_params()
    optimizer._param_slice_mappings = optimizer._create_param_mapping()
    return True
