"""Accelerate integration: one ``Accelerator`` drives any number of MultiEngines, each with its own config.

:class:`Accelerator` is a drop-in for ``accelerate.Accelerator``. Each ``prepare`` call builds a
MultiEngine for one model, from the selected plugin or the ``deepspeed_plugin=`` given for that
call; ``backward(loss)`` is one backward through every engine the loss reaches; each prepared
optimizer (:class:`EngineOptimizer`) and scheduler (:class:`UpdateScheduler`) follows its own
engine:

```python
from deepspeed_multi.accelerate import Accelerator   # instead of accelerate.Accelerator

accelerator = Accelerator(deepspeed_plugins={"default": DeepSpeedPlugin(hf_ds_config=zero2)})
student, opt = accelerator.prepare(student, torch.optim.SGD(student.parameters(), lr=0.05))
teacher = accelerator.prepare(teacher, deepspeed_plugin=zero3)   # no optimizer: frozen, at ZeRO-3

accelerator.backward(loss_fn(student(x), teacher(x)))            # steps nothing
opt.step(); opt.zero_grad()                                      # the student's engine
```

Needs ``accelerate`` (``pip install 'deepspeed_multi[hf]'``); the core ``deepspeed_multi``
package does not import this subpackage.
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
