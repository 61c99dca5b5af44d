"""deepspeed_multi.transformers without processes: the Trainer classes it builds (the multi-process
tests against a DDP Trainer are tests/multi_gpu/test_trainer.py)."""
import pytest

transformers = pytest.importorskip("transformers")

from deepspeed_multi import transformers as dsm_transformers  # noqa: E402


def test_one_class_per_trainer_class_built_once():
    class MyTrainer(transformers.Trainer):
        pass

    built = dsm_transformers.multi_engine_trainer(MyTrainer)
    assert built is dsm_transformers.multi_engine_trainer(MyTrainer)
    assert issubclass(built, MyTrainer) and built.__name__ == "MultiEngineMyTrainer"
    assert built.create_accelerator_and_postprocess is not MyTrainer.create_accelerator_and_postprocess
    assert dsm_transformers.Trainer is dsm_transformers.multi_engine_trainer(transformers.Trainer)


@pytest.mark.parametrize("bad", [object, transformers.TrainingArguments, "Trainer"])
def test_not_a_trainer_is_refused(bad):
    with pytest.raises(TypeError, match="expected transformers.Trainer or a subclass"):
        dsm_transformers.multi_engine_trainer(bad)
