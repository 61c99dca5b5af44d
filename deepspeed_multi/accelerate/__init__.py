"""Accelerate integration: one ``Accelerator`` drives any number of MultiEngines.

    from deepspeed_multi.accelerate import Accelerator

is a drop-in for ``accelerate.Accelerator``. Needs ``accelerate`` (``pip install
deepspeed_multi[hf]``); the core ``deepspeed_multi`` package does not import this subpackage.
"""
try:
    from .accelerator import Accelerator
    from .wrappers import EngineOptimizer, UpdateScheduler
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    if e.name != "accelerate" and not str(e.name).startswith("accelerate."):
        raise
    raise ImportError("deepspeed_multi.accelerate needs Hugging Face Accelerate: pip install "
                      "'deepspeed_multi[hf]' (or accelerate==1.15.0 without letting pip replace torch).") from e

__all__ = ["Accelerator", "EngineOptimizer", "UpdateScheduler"]
