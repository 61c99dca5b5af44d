"""``engine.destroy()``: the module handed back as DeepSpeed's own destroy() leaves it.

[Note: destroy() hands the module back]
``DeepSpeedEngine.destroy()`` takes ZeRO's hooks off the module and its parameters so that a new
engine can be built over the same module. Accelerate's ``free_memory()`` calls it (and every
``Trainer.train()`` calls that before it builds its engine): a new Trainer over a trained model,
an ``evaluate()`` engine replaced by the training one, a model prepared again. A MultiEngine puts
more on the module than DeepSpeed does: the region's forward hooks on every submodule
(autograd/region.py), the direct-use and skip-group checks on the parameters' gradient
accumulators, the watchdog's forward hooks, at ZeRO-3 the parameters' names for the
discarded-write warning (reliability/discarded_writes.py) and the module's ``generate``
(zero/stage3/generation.py) and, at bf16/fp16 ZeRO-3, the
parameters' 16-bit partitions released (zero/stage3/cast_on_gather.py). Left there they would act for the
destroyed engine inside the new one's forward and backward (its epilogue on freed buckets: an
IndexError at ZeRO-2), and the new engine would build its partitions from the released
placeholders (NaN, silently, at bf16 ZeRO-3).

So ``destroy()`` drains ZeRO-3's prefetch, takes all of ours off, rebuilds DeepSpeed's 16-bit
partitions from the masters (the values DeepSpeed's layout holds: the new engine gets
DeepSpeed's bits), takes the engine out of the process-wide registries (watchdog, skip group,
data-parallel groups, the parameters' and modules' owner) and, at ZeRO-3, drops the backward
functions DeepSpeed creates once per module and leaves bound to the old engine
(``zero.stage3.counters.forget``); then DeepSpeed's destroy() runs. The engine refuses any use
after, with an error that says to build a new one. An engine dropped without ``destroy()`` gets
DeepSpeed's part only, when it is garbage-collected (:func:`at_garbage_collection`), which
DeepSpeed's own forward hooks put off for as long as its module lives; until then a new engine
over that module is refused where the old one's hooks would act in it (``reliability/misuse.py``).
"""
import logging

from deepspeed.runtime.engine import DeepSpeedEngine

from . import zero
from .autograd import outside_use
from .reliability import discarded_writes, dp_groups, misuse, watchdog
from .state import TrainingState
from .zero.stage3 import counters as stage3_counters
from .zero.stage3 import generation as stage3_generation
from .zero.stage3 import prefetch as stage3_prefetch

logger = logging.getLogger(__name__)


def hand_back(engine) -> None:
    """Everything MultiEngine added to ``engine.module`` and this process, taken off (see the Note)."""
    stage3_prefetch.drain(engine)
    engine._region.remove()
    outside_use.uninstall(engine)
    if engine.skip_group is not None:
        engine.skip_group.remove(engine)
    watchdog.detach(engine)
    dp_groups.unregister_dp_group(engine)
    misuse.release_parameters(engine)
    if engine.optimizer is not None:
        zero.hand_back(engine.optimizer)
    if engine.zero_optimization_stage() == 3:
        stage3_counters.forget(engine.module)
        discarded_writes.forget(engine)
        stage3_generation.forget(engine)


def at_garbage_collection(engine) -> None:
    """``MultiEngine.__del__``. DeepSpeed's ``__del__`` calls ``destroy()``, and garbage collection
    can come at any point of other engines' work (inside a loop over a module's hooks or over a
    registry that the hand back edits: "dictionary changed size during iteration"). So only
    DeepSpeed's part runs then, as before MultiEngine had a destroy() of its own; the hooks of an
    engine that is gone do nothing (they hold it weakly)."""
    if getattr(engine, "_state", None) is TrainingState.DESTROYED:
        return
    try:
        DeepSpeedEngine.destroy(engine)
    except Exception as exc:  # noqa: BLE001 - as DeepSpeed's __del__: a half-built engine has nothing to free
        logger.debug("MultiEngine.__del__: DeepSpeed's cleanup skipped: %s", exc)
