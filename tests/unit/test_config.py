"""Config handling: our options are taken out, DeepSpeed runs unmanaged, bad input is refused."""
import pytest
import torch

from deepspeed_multi.config import MultiOptions, load_config, prepare_engine_config, zero_stage


def test_engine_config_is_unmanaged_and_options_removed():
    given = {"zero_optimization": {"stage": 2}, "deepspeed_multi": {"fused_reduce": False, "skip_group": "g"}}
    config, user_managed, options = prepare_engine_config(load_config(given))
    assert config["managed_gradient_accumulation"] is False and "deepspeed_multi" not in config
    assert not user_managed and options == MultiOptions(fused_reduce=False, skip_group="g")
    assert "deepspeed_multi" in given, "the caller's dict must not be modified"


def test_user_managed_boundary_is_kept():
    _, user_managed, options = prepare_engine_config({"managed_gradient_accumulation": False})
    assert user_managed and options == MultiOptions()


def test_unknown_option_names_the_key():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['fuse'\].*known options"):
        prepare_engine_config({"deepspeed_multi": {"fuse": True}})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_below_stage2_is_dropped_for_deepspeed(stage):
    """[Note: overlap_comm below ZeRO-2]: accepted at every stage, as upstream accepts it; DeepSpeed sees it
    from stage 2 on only, and a ZeRO-1 engine is told to reduce in its backward's order."""
    config, _, options = prepare_engine_config({"zero_optimization": {"stage": stage, "overlap_comm": True}})
    assert ("overlap_comm" in config["zero_optimization"]) == (stage >= 2)
    assert options.zero1_overlap_comm == (stage == 1)
    _, _, options = prepare_engine_config({"zero_optimization": {"stage": 1, "overlap_comm": False}})
    assert not options.zero1_overlap_comm


def test_the_internal_option_is_not_a_user_option():
    with pytest.raises(ValueError, match="unknown option.*zero1_overlap_comm"):
        prepare_engine_config({"deepspeed_multi": {"zero1_overlap_comm": True}})


@pytest.mark.parametrize("stage", [1, 2])
def test_noncontiguous_zero12_refused_on_releases_that_get_it_wrong(monkeypatch, stage):
    from deepspeed_multi import compat
    cfg = {"zero_optimization": {"stage": stage, "contiguous_gradients": False}}
    monkeypatch.setattr(compat, "installed_version", lambda: "0.19.4")
    with pytest.raises(ValueError, match=f"contiguous_gradients=false at ZeRO stage {stage}.*0.19.4.*contiguous_gradients true"):
        prepare_engine_config(dict(cfg, zero_optimization=dict(cfg["zero_optimization"])))
    monkeypatch.setattr(compat, "installed_version", lambda: "0.19.8")
    prepare_engine_config(dict(cfg, zero_optimization=dict(cfg["zero_optimization"])))


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_offload_refused_on_releases_before_the_measured_one(monkeypatch, key):
    from deepspeed_multi import compat
    cfg = {"zero_optimization": {"stage": 3, key: {"device": "cpu"}}}
    monkeypatch.setattr(compat, "installed_version", lambda: "0.19.4")
    with pytest.raises(ValueError, match=f"{key} .*needs DeepSpeed 0.19.8 here, found 0.19.4.*remove the offload"):
        prepare_engine_config(dict(cfg, zero_optimization=dict(cfg["zero_optimization"])))
    prepare_engine_config({"zero_optimization": {"stage": 3, key: {"device": "none"}}})  # "none" is no offload
    monkeypatch.setattr(compat, "installed_version", lambda: "0.19.8")
    prepare_engine_config(dict(cfg, zero_optimization=dict(cfg["zero_optimization"])))


@pytest.mark.parametrize("config,feature", [
    ({"compile": {"deepcompile": True}}, "DeepCompile (compile.deepcompile)"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}},
     "ZenFlow (zero_optimization.zenflow)"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
     "SuperOffload (zero_optimization.offload_optimizer.super_offload)"),
    ({"hybrid_engine": {"enabled": True}}, "the hybrid engine (hybrid_engine.enabled)"),
    ({"compile": {"deepcompile": False}, "hybrid_engine": {"enabled": False},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, None)])
def test_boundary_owning_features_go_to_the_managed_path(config, feature):
    """[Note: the drop-in rule]: these build as upstream builds them (refused only at a backward that
    reaches them beside another engine: test_drop_in.py); engine.compile() alone or an offload is ours."""
    from deepspeed_multi.reliability import managed_path as managed
    assert managed.feature_of(torch.nn.Linear(2, 2), config) == feature


def test_a_pipeline_module_goes_to_the_managed_path():
    from deepspeed.pipe import LayerSpec, PipelineModule

    from deepspeed_multi.reliability import managed_path as managed
    with pytest.MonkeyPatch.context() as mp:  # PipelineModule's constructor needs a process group
        mp.setattr(PipelineModule, "__init__", lambda self, *a, **k: torch.nn.Module.__init__(self))
        assert managed.feature_of(PipelineModule([LayerSpec(torch.nn.Linear, 2, 2)]), {}) == \
            "pipeline parallelism (a PipelineModule)"


def test_load_config_from_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    assert zero_stage(load_config(str(path))) == 3
    assert zero_stage({}) == 0


def test_watchdog_timeout_default_and_bad_values():
    assert MultiOptions().watchdog_timeout_s == 300
    assert MultiOptions.from_config({"deepspeed_multi": {"watchdog_timeout_s": 0}}).watchdog_timeout_s == 0
    for bad in (-1, "300", True):
        with pytest.raises(ValueError, match=r"watchdog_timeout_s must be a number of seconds >= 0.*got"):
            MultiOptions.from_config({"deepspeed_multi": {"watchdog_timeout_s": bad}})


def test_allow_mixed_dp_groups_default_and_bad_values():
    assert MultiOptions().allow_mixed_dp_groups is False
    options = MultiOptions.from_config({"deepspeed_multi": {"allow_mixed_dp_groups": True}})
    assert options.allow_mixed_dp_groups is True
    for bad in (1, "true", None):
        with pytest.raises(ValueError, match=r"allow_mixed_dp_groups must be true or false; got"):
            MultiOptions.from_config({"deepspeed_multi": {"allow_mixed_dp_groups": bad}})


def test_direct_use_check_updates_default_and_bad_values():
    assert MultiOptions().direct_use_check_updates == 1
    for good in (-1, 0, 3):
        options = MultiOptions.from_config({"deepspeed_multi": {"direct_use_check_updates": good}})
        assert options.direct_use_check_updates == good
    for bad in (-2, 1.5, True, "1", None):
        with pytest.raises(ValueError, match=r"direct_use_check_updates must be an integer >= -1.*got"):
            MultiOptions.from_config({"deepspeed_multi": {"direct_use_check_updates": bad}})


@pytest.mark.parametrize("stage,dtype,refused", [(1, "bf16", True), (2, "fp16", True), (0, "bf16", True),
                                                 (3, "bf16", False), (2, "fp32", False)])
def test_universal_load_of_16bit_below_zero3_refused_on_releases_that_get_it_wrong(monkeypatch, stage, dtype, refused):
    """deepspeed_multi/resize.py: a resume at another world size, which DeepSpeed 0.19.4-0.19.6 get wrong there."""
    import types

    from deepspeed_multi import compat
    from deepspeed_multi.checkpoint import resize
    loads = []
    engine = types.SimpleNamespace(
        bfloat16_enabled=lambda: dtype == "bf16", fp16_enabled=lambda: dtype == "fp16",
        zero_optimization_stage=lambda: stage, _config=types.SimpleNamespace(load_universal_checkpoint=False),
        load_checkpoint=lambda root, tag: loads.append((root, tag)) or ("path", {}))
    monkeypatch.setattr(compat, "installed_version", lambda: "0.19.4")
    if refused:
        with pytest.raises(RuntimeError, match=f"engine 'enc' \\(ZeRO stage {stage}, {dtype}\\).*0.19.4.*0.19.7"):
            resize.load_universal(engine, "/ckpt", "enc")
        assert not loads
    else:
        resize.load_universal(engine, "/ckpt", "enc")
        assert loads == [("/ckpt", "enc")]
    for version in ("0.19.7", "0.19.8"):
        monkeypatch.setattr(compat, "installed_version", lambda: version)
        resize.load_universal(engine, "/ckpt", "enc")
    assert loads[-1] == ("/ckpt", "enc") and engine._config.load_universal_checkpoint is False


@pytest.mark.parametrize("zero, stage", [(True, 1), (False, 0), ({"stage": "2"}, 2), ({"stage": 3.0}, 3)])
def test_zero_section_read_as_deepspeed_reads_it(zero, stage):
    """DeepSpeed's deprecated true/false form and the stages it coerces: the stage DeepSpeed builds, as an int."""
    config = load_config({"zero_optimization": zero})
    assert zero_stage(config) == stage and type(config["zero_optimization"]["stage"]) is int


@pytest.mark.parametrize("config, key", [
    ({"zero_optimization": None}, '"zero_optimization" is None'),
    ({"zero_optimization": [2]}, '"zero_optimization" is [2]'),
    ({"zero_optimization": {"stage": None}}, '"zero_optimization.stage" is None'),
    ({"zero_optimization": {"stage": 4}}, '"zero_optimization.stage" is 4'),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}, '"zero_optimization.offload_optimizer"'),
    ({"zero_optimization": {"stage": 3, "offload_param": True}}, '"zero_optimization.offload_param"'),
    ({"steps_per_print": 0}, '"steps_per_print" is 0'),
])
def test_malformed_config_names_the_key(config, key):
    """What DeepSpeed refuses (or divides by, on rank 0 only) is refused before any engine, naming the key and value
    (it failed inside this package's own code with an AttributeError or TypeError)."""
    with pytest.raises(ValueError, match="expected|Set a positive") as e:
        load_config(config)
    assert key in str(e.value), str(e.value)
