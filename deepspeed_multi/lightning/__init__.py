"""Lightning over MultiEngines: several DeepSpeed models, each with its own config, under one backward.

One change for the user, the strategy::

    fabric = Fabric(strategy=MultiDeepSpeedStrategy(config=ds_config), devices=2)

(``from deepspeed_multi.lightning import MultiDeepSpeedStrategy``). Every ``fabric.setup(model,
optimizer)`` then builds a :class:`~deepspeed_multi.MultiEngine` with the model's own config
(see fabric.py), and the rest of the loop is the one written for DDP. Importing this package
does not import Lightning; the strategy is built on first use. For the PyTorch Lightning Trainer:
``Trainer(strategy=MultiDeepSpeedTrainerStrategy(config=..., configs={...}))`` (trainer.py).
"""
from .versions import TESTED, check_lightning

__all__ = ["MultiDeepSpeedStrategy", "MultiDeepSpeedTrainerStrategy", "TESTED", "check_lightning", "with_config"]


def __getattr__(name):
    if name in ("MultiDeepSpeedStrategy", "with_config"):
        from . import fabric
        return getattr(fabric, name)
    if name == "MultiDeepSpeedTrainerStrategy":
        from . import trainer
        return trainer.MultiDeepSpeedTrainerStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
