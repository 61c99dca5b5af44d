"""One model, several ZeRO stages: a DeepSpeed config per declared submodule (plan.py), one
engine object for the whole model (engine.py)."""
from .engine import PartedEngine, PartsOptimizer
from .plan import REST, declared_submodules

__all__ = ["PartedEngine", "PartsOptimizer", "REST", "declared_submodules"]
