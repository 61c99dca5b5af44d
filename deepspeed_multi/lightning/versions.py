"""The Lightning releases deepspeed_multi.lightning is measured with (tests/multi_gpu/test_lightning.py)."""
import importlib.metadata as md

from .. import compat
from ..switches import ALLOW_UNTESTED_LIGHTNING, switch_on

TESTED = ("2.6",)  # major.minor


def check_lightning() -> None:
    """Refuse a Lightning release other than the tested ones: the strategy hooks into its Fabric
    and connector code paths (setup, backward, optimizer step, checkpointing)."""
    try:
        installed = md.version("lightning")
    except md.PackageNotFoundError:
        raise ImportError("deepspeed_multi.lightning needs Lightning: pip install 'deepspeed_multi[lightning]' "
                          f"(lightning {TESTED[-1]}.x).") from None
    if (compat._version_tuple(installed)[:2] not in [compat._version_tuple(t) for t in TESTED]
            and not switch_on(ALLOW_UNTESTED_LIGHTNING, False)):
        listed = " and ".join(f"{t}.x" for t in TESTED)
        raise RuntimeError(
            f"deepspeed_multi.lightning was tested with lightning {listed}; this environment has lightning "
            f"{installed}. Install lightning=={TESTED[-1]}.* (pip install 'deepspeed_multi[lightning]'), or set "
            f"{ALLOW_UNTESTED_LIGHTNING}=1 to run anyway (compare its losses with a DDP run first).")
