"""deepspeed_multi: one plain ``loss.backward()`` through any number of DeepSpeed engines.

    engine, optimizer, _, scheduler = deepspeed_multi.initialize(model=..., config=...)

is a drop-in for ``deepspeed.initialize``; the engine is a :class:`MultiEngine`.
"""
from .checkpoint import load_checkpoint, remove_checkpoint, save_checkpoint
from .engine import MultiEngine
from .initialize import initialize
from .integrations.zero_init import zero_init
from .state import TrainingState

__all__ = ["MultiEngine", "TrainingState", "initialize", "load_checkpoint", "remove_checkpoint", "report", "save_checkpoint",
           "zero_init"]
__version__ = "0.1.0"  # the one place: pyproject.toml reads it from this line (a literal, without importing)


def __getattr__(name):
    # The environment report for bug reports (deepspeed_multi.report(), python -m deepspeed_multi.report) is
    # imported on first use: importing it here would make `python -m` find its module already imported.
    # The module is callable: deepspeed_multi.report() prints the report.
    if name == "report":
        import importlib
        return importlib.import_module(f"{__name__}.report")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
