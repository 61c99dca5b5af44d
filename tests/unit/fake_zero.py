"""Fake ZeRO optimizers for single-process tests, checked against the compat layer's table.

A fake is ``object.__new__`` of DeepSpeed's optimizer class (or of a subclass a test defines)
with only the attributes the test gives it. Each name given in ``attrs`` must be one that
deepspeed_multi/touch_points.tsv lists for that class (what our code reads, writes or replaces),
so the fakes keep no second list of DeepSpeed's names: a fake that needs a new one fails here,
naming the table. ``oracle`` holds what only DeepSpeed's own method reads, where a test runs it
as the oracle beside ours; the package itself never touches those.
"""
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from deepspeed_multi import compat


def _owner(cls) -> str:
    for base in (DeepSpeedZeroOptimizer_Stage3, DeepSpeedZeroOptimizer):
        if issubclass(cls, base):
            return base.__name__
    raise TypeError(f"fake_zero.fake: {cls!r} is not a DeepSpeed ZeRO optimizer class")


def listed(owner: str) -> set:
    return {tp.name for tp in compat.TOUCH_POINTS if tp.owner == owner}


def fake(cls, oracle=None, **attrs):
    """``object.__new__(cls)`` with ``attrs`` (names from the touch-point table) and ``oracle``."""
    owner = _owner(cls)
    unknown = sorted(n for n in attrs if not n.startswith("_dsm") and n not in listed(owner))
    if unknown:
        raise AssertionError(f"fake {owner}: {unknown} are not in deepspeed_multi/touch_points.tsv for {owner}. "
                             "If the package reads or writes them, add them there (how, our module); if only "
                             "DeepSpeed's own method reads them in this test, pass them as oracle={...}.")
    opt = object.__new__(cls)
    vars(opt).update(oracle or {})
    vars(opt).update(attrs)
    return opt
