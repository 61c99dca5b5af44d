"""The Lightning releases deepspeed_multi.lightning is measured with (tests/multi_gpu/test_lightning.py)."""
import importlib.metadata as md

from .. import compat
from ..switches import ALLOW_UNTESTED_LIGHTNING

TESTED = ("2.6",)  # major.minor


def check_lightning() -> None:
    """Refuse a Lightning release other than the tested ones (``TESTED``).

    The strategies hook into Lightning's Fabric and connector code paths (setup, backward, optimizer
    step, checkpointing); ``DSM_ALLOW_UNTESTED_LIGHTNING=1`` runs another release anyway. Both
    strategies call it when they are built.

    Raises:
        ImportError: when Lightning is not installed.
        RuntimeError: when the installed release is not one in ``TESTED`` and the switch is off; the
            message names the tested releases, the installed one and the switch.
    """
    try:
        installed = md.version("lightning")
    except md.PackageNotFoundError:
        raise ImportError("deepspeed_multi.lightning needs Lightning: pip install 'deepspeed_multi[lightning]' "
                          f"(lightning {TESTED[-1]}.x).") from None
    compat.check_tested_release("deepspeed_multi.lightning", "lightning", installed, TESTED, "lightning",
                                ALLOW_UNTESTED_LIGHTNING, "anyway (compare its losses with a DDP run first)")
