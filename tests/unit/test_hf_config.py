"""zero_init / hf_deepspeed_config set Transformers' global DeepSpeed config for their block and put
back what was there (here: a config registered before, as an Accelerate plugin's selection does)."""
import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def _cfg(stage):
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}


def test_blocks_set_and_restore_the_global_config():
    from transformers.integrations import HfDeepSpeedConfig, deepspeed_config, is_deepspeed_zero3_enabled
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import deepspeed_multi
    from deepspeed_multi.integrations.hf_config import hf_deepspeed_config
    try:
        outer = HfDeepSpeedConfig(_cfg(3))      # e.g. a selected stage-3 Accelerate plugin
        with deepspeed_multi.zero_init(_cfg(2)):
            assert not is_deepspeed_zero3_enabled(), "a stage-2 block must hide the outer stage-3 config"
        assert is_deepspeed_zero3_enabled() and deepspeed_config() is outer.config
        inner = _cfg(3)
        inner["zero_optimization"]["stage3_param_persistence_threshold"] = 7
        with hf_deepspeed_config(inner):
            assert deepspeed_config()["zero_optimization"]["stage3_param_persistence_threshold"] == 7
        assert deepspeed_config() is outer.config
        del outer
        with hf_deepspeed_config(_cfg(2)):
            assert not is_deepspeed_zero3_enabled()
        assert deepspeed_config() is None, "nothing was registered before (the outer config is gone)"
    finally:
        unset_hf_deepspeed_config()
