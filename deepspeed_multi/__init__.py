"""deepspeed_multi: one plain ``loss.backward()`` through any number of DeepSpeed engines.

    engine, optimizer, _, scheduler = deepspeed_multi.initialize(model=..., config=...)

is a drop-in for ``deepspeed.initialize``; the engine is a :class:`MultiEngine`.
"""
from .checkpoint import load_checkpoint, save_checkpoint
from .engine import MultiEngine
from .initialize import initialize
from .integrations.zero_init import zero_init
from .state import TrainingState

__all__ = ["MultiEngine", "TrainingState", "initialize", "load_checkpoint", "save_checkpoint", "zero_init"]
__version__ = "0.1.0"
