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


def test_unknown_role_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['critic'\].*ref_model"):
        dsm_transformers.Trainer(deepspeed_roles={"critic": {"zero_optimization": {"stage": 3}}})


def test_roles_for_a_trainer_without_extra_models_are_refused():
    with pytest.raises(ValueError, match="prepares no extra models"):
        dsm_transformers.Trainer(deepspeed_roles={"ref_model": {"zero_optimization": {"stage": 3}}})


def test_role_config_inherits_the_policy_config_less_its_training_sections():
    class State:
        class deepspeed_plugin:
            deepspeed_config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                "scheduler": {"type": "WarmupLR"}, "gradient_clipping": 1.0,
                                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                      "reduce_bucket_size": 100}}

    class Acc:
        state = State

    cfg = dsm_transformers.role_config(Acc, {"zero_optimization": {"stage": 3}})
    assert cfg == {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                   "zero_optimization": {"stage": 3, "reduce_bucket_size": 100}}
    assert "optimizer" in State.deepspeed_plugin.deepspeed_config  # the policy's own config is untouched


def _acc(config):
    class Acc:
        class state:
            class deepspeed_plugin:
                deepspeed_config = config
    return Acc


@pytest.mark.parametrize("given,match", [
    ({"optimizer": {"type": "AdamW"}}, r"deepspeed_roles\['ref_model'\] sets \['optimizer'\].*frozen"),
    ({"scheduler": {"type": "WarmupLR"}}, r"sets \['scheduler'\].*frozen"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     r"zero_optimization.offload_optimizer.*frozen"),
    ({"train_micro_batch_size_per_gpu": 4}, r"train_micro_batch_size_per_gpu=4 but the policy's config has "
                                            r"train_micro_batch_size_per_gpu=2"),
    ({"gradient_accumulation_steps": 2}, r"gradient_accumulation_steps=2 but the policy's .*=1"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enables both fp16 and bf16"),
])
def test_a_role_config_that_contradicts_the_policy_is_refused(given, match):
    policy = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=match):
        dsm_transformers.role_config(_acc(policy), given, "ref_model")


def test_a_role_may_name_its_own_precision_and_auto_batch_keys():
    policy = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "fp16": {"enabled": True},
              "zero_optimization": {"stage": 2}}
    cfg = dsm_transformers.role_config(_acc(policy), {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2,
                                                      "gradient_accumulation_steps": "auto"})
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg      # the policy's fp16 is dropped for this role
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 1
    assert dsm_transformers.role_config(_acc(policy), {"zero_optimization": {"stage": 3}})["fp16"] == {"enabled": True}


def test_an_untested_transformers_or_trl_is_refused_with_the_fix(monkeypatch):
    import importlib.metadata as md
    real = md.version
    monkeypatch.setattr(md, "version", lambda p: "5.99.0" if p == "transformers" else real(p))
    monkeypatch.delenv("DSM_ALLOW_UNTESTED_TRAINERS", raising=False)

    class Another(transformers.Trainer):
        pass

    with pytest.raises(RuntimeError, match=r"tested with transformers 5\.23\.x and 5\.24\.x; this environment has "
                                           r"transformers 5\.99\.0.*DSM_ALLOW_UNTESTED_TRAINERS=1"):
        dsm_transformers.multi_engine_trainer(Another)
    monkeypatch.setenv("DSM_ALLOW_UNTESTED_TRAINERS", "1")
    assert issubclass(dsm_transformers.multi_engine_trainer(Another), Another)


@pytest.mark.parametrize("version", ["5.23.0", "5.23.4", "5.24.0", "5.24.2.dev0"])
def test_every_tested_transformers_minor_release_is_accepted(monkeypatch, version):
    import importlib.metadata as md
    real = md.version
    monkeypatch.setattr(md, "version", lambda p: version if p == "transformers" else real(p))
    monkeypatch.delenv("DSM_ALLOW_UNTESTED_TRAINERS", raising=False)

    class Tested(transformers.Trainer):
        pass

    dsm_transformers.check_versions(Tested)  # no error


def test_the_trl_internals_trl_stages_relies_on_are_there():
    """integrations/trl_stages.py swaps or calls these (touch_points.tsv); each silently doing
    nothing if TRL renamed it would bring back the one-config bugs, so a rename fails here."""
    pytest.importorskip("trl")
    import importlib

    import transformers.integrations.deepspeed as hf_ds
    from trl.trainer.callbacks import SyncRefModelCallback
    utils = importlib.import_module("trl.trainer.utils")
    divergence = importlib.import_module("trl.kernels.chunked_divergence")
    assert callable(hf_ds.is_deepspeed_zero3_enabled)
    assert divergence.maybe_gather_lm_head_ctx is utils.maybe_gather_lm_head_ctx
    assert callable(SyncRefModelCallback.sync_target_model) and callable(SyncRefModelCallback._sync_target_model)


def test_the_trainer_checkpoint_hooks_are_there():
    """transformers.py saves and restores the role models' state from these two Trainer methods
    (touch_points.tsv; [Note: role models in Trainer checkpoints]); a rename would silently drop the
    role state from every checkpoint, so it fails here."""
    import inspect

    import transformers
    for name, argument in (("_save_optimizer_and_scheduler", "output_dir"),
                           ("_load_optimizer_and_scheduler", "checkpoint")):
        method = getattr(transformers.Trainer, name, None)
        assert callable(method), f"transformers.Trainer.{name} is gone"
        assert list(inspect.signature(method).parameters) == ["self", argument], inspect.signature(method)
