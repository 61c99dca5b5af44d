"""Reading a DeepSpeed config the way deepspeed.initialize does, and our own keys."""
import copy
from dataclasses import dataclass, fields
from typing import Optional

from deepspeed.runtime.constants import MANAGED_GRADIENT_ACCUMULATION


def load_config(config):
    """A fresh dict from a dict or a path (JSON/HJSON, as DeepSpeed accepts)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    return load_ds_config(config)


def zero_stage(config: dict) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def prepare_engine_config(config: dict):
    """Return (config for DeepSpeed, whether the user owns the accumulation boundary, our options).

    [Note: who owns the gradient-accumulation boundary]
    MultiEngine runs DeepSpeed with ``managed_gradient_accumulation=false``: every backward
    only accumulates, and DeepSpeed finalizes and updates when asked. That gives PyTorch's
    meaning to several backward calls before a step, to zero_grad(), and to engines of
    different gradient_accumulation_steps in one graph. MultiEngine.step() then applies the
    update at the end of each window of gradient_accumulation_steps step() calls, as DeepSpeed
    does by default, unless the user set managed_gradient_accumulation=false themselves, in
    which case every step() updates.
    """
    options = MultiOptions.from_config(config)
    user_managed = config.get(MANAGED_GRADIENT_ACCUMULATION, True) is False
    config[MANAGED_GRADIENT_ACCUMULATION] = False
    stage = zero_stage(config)
    overlap = config.get("zero_optimization", {}).get("overlap_comm", False)
    if stage == 1 and overlap:
        raise ValueError("deepspeed_multi: zero_optimization.overlap_comm=true is not supported with ZeRO stage 1 "
                         "(DeepSpeed supports it only with managed accumulation). Set overlap_comm to false, or use "
                         "stage 2, which reduces during backward anyway.")
    return config, user_managed, options


OPTIONS_KEY = "deepspeed_multi"


@dataclass
class MultiOptions:
    """Our own options, under the config key "deepspeed_multi" (removed before DeepSpeed sees it).

    fused_reduce: use the fused gradient-bucket ops (deepspeed_multi.ops) in the ZeRO-2/3
        reduction path; the pure-PyTorch reference runs where no compiler is available.
    skip_group: engines with the same name skip their updates together when any of them has
        non-finite gradients (see skip_group.py).
    """
    fused_reduce: bool = True
    skip_group: Optional[str] = None

    @classmethod
    def from_config(cls, config: dict) -> "MultiOptions":
        given = config.pop(OPTIONS_KEY, None) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"deepspeed_multi: unknown option(s) {unknown} under config key {OPTIONS_KEY!r}; "
                             f"known options: {sorted(known)}.")
        return cls(**given)
