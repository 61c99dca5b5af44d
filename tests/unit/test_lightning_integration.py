"""deepspeed_multi.lightning without processes: the version gate and the per-model config rules
(tests/multi_gpu/test_lightning.py runs the strategy against DDP)."""
import importlib.metadata as md

import pytest

pytest.importorskip("lightning")

from deepspeed_multi.lightning import configs, versions  # noqa: E402


def _as_lightning(monkeypatch, version):
    real = md.version
    monkeypatch.setattr(md, "version", lambda p: version if p == "lightning" else real(p))
    monkeypatch.delenv("DSM_ALLOW_UNTESTED_LIGHTNING", raising=False)


def test_an_untested_lightning_is_refused_with_the_fix(monkeypatch):
    _as_lightning(monkeypatch, "2.7.0")
    with pytest.raises(RuntimeError, match=r"tested with lightning 2\.6\.x; this environment has lightning 2\.7\.0.*"
                                           r"DSM_ALLOW_UNTESTED_LIGHTNING=1"):
        versions.check_lightning()
    from deepspeed_multi.lightning import MultiDeepSpeedStrategy
    with pytest.raises(RuntimeError, match="tested with lightning"):   # the strategy refuses before anything runs
        MultiDeepSpeedStrategy()
    monkeypatch.setenv("DSM_ALLOW_UNTESTED_LIGHTNING", "1")
    versions.check_lightning()


@pytest.mark.parametrize("version", ["2.6.0", "2.6.6", "2.6.7.dev0"])
def test_every_tested_lightning_release_is_accepted(monkeypatch, version):
    _as_lightning(monkeypatch, version)
    versions.check_lightning()


def _config(base, own, precision="32-true", trains=True):
    from lightning.fabric.strategies.deepspeed import _format_precision_config

    def fill(cfg):
        _format_precision_config(cfg, precision, 0, 1000, 1, 16, 2)
    return configs.engine_config(base, own, "Net", precision, fill, trains)


def test_a_model_config_merges_over_the_strategys_and_precision_fills_it():
    base = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 64},
            "optimizer": {"type": "Adam"}}
    frozen = _config(base, {"zero_optimization": {"stage": 3}}, precision="bf16-true", trains=False)
    assert frozen["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 64}
    assert frozen["bf16"] == {"enabled": True} and "optimizer" not in frozen
    assert frozen["gradient_clipping"] == 0.0 and frozen["gradient_accumulation_steps"] == 1
    assert _config({}, None)["train_micro_batch_size_per_gpu"] == 1


@pytest.mark.parametrize("base,own,precision,text", [
    ({}, {"gradient_accumulation_steps": 2}, "32-true", "the loop owns accumulation"),
    ({"gradient_accumulation_steps": 3}, None, "32-true", "the strategy's DeepSpeed config sets"),
    ({"train_batch_size": 8}, {"train_batch_size": 16}, "32-true", "train_batch_size=16"),
    ({}, {"fp16": {"enabled": True}}, "bf16-mixed", "enables fp16 but Fabric runs with precision='bf16-mixed'"),
    ({}, {"bf16": {"enabled": False}}, "bf16-true", "disables bf16"),
    ({}, {"optimizer": {"type": "Adam"}}, "32-true", "\"optimizer\" section"),
])
def test_contradicting_configs_are_refused(base, own, precision, text):
    with pytest.raises(ValueError, match=None) as e:
        _config(base, own, precision)
    assert text in str(e.value)


def test_the_installed_pins_are_the_tested_releases():
    """pyproject.toml's extra and requirements-test.txt install a Lightning the gate accepts (make test tests it)."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2]
    pins = re.findall(r"lightning==(\d+\.\d+)\.\d+", (root / "requirements-test.txt").read_text())
    pins += re.findall(r"\"lightning==(\d+\.\d+)\.\d+\"", (root / "pyproject.toml").read_text())
    assert len(pins) == 2 and set(pins) <= set(versions.TESTED), pins
