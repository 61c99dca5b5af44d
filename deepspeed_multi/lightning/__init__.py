"""Lightning over MultiEngines: several DeepSpeed models, each with its own config, under one backward.

One change for the user, the strategy. Under Fabric, every ``fabric.setup(model, optimizer)``
builds a :class:`~deepspeed_multi.MultiEngine` with the model's own config
(:class:`MultiDeepSpeedStrategy`), and the rest of the loop is the one written for DDP; under the
PyTorch Lightning Trainer, each model the LightningModule holds becomes an engine
(:class:`MultiDeepSpeedTrainerStrategy`):

```python
from deepspeed_multi.lightning import MultiDeepSpeedStrategy, MultiDeepSpeedTrainerStrategy, with_config

fabric = Fabric(strategy=MultiDeepSpeedStrategy(config=ds_zero2), devices=2)   # was: strategy="ddp"
generator, opt_g = fabric.setup(generator, opt_g)              # each its own engine
teacher = fabric.setup(with_config(teacher, ds_zero3))         # frozen, at ZeRO-3

Trainer(strategy=MultiDeepSpeedTrainerStrategy(config=ds_zero2, configs={"teacher": ds_zero3}))
```

``TESTED`` holds the Lightning releases (major.minor) the strategies are measured with;
:func:`check_lightning` refuses others. Importing this package does not import Lightning; the
strategies are built on first use.
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
