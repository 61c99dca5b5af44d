"""The compat layer (deepspeed_multi/compat.py): the version gate, the exact-method check, the
replacement registry, and the package rules it makes checkable (single process).

The end-to-end half (fast paths off over changed methods and outside the window, results exact)
is tests/multi_gpu/test_compat_e2e.py.
"""
import logging
import re
from pathlib import Path
from unittest import mock

import pytest
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from deepspeed_multi import compat
from deepspeed_multi.zero.stage12 import reduce as stage12_reduce
from fake_zero import fake

PACKAGE = Path(compat.__file__).resolve().parent
ROOT = PACKAGE.parent


@pytest.fixture(autouse=True)
def _fresh_gate():
    compat.check_deepspeed.cache_clear()
    yield
    compat.check_deepspeed.cache_clear()


# ------------------------------------------------------------------------------ version gate
@pytest.mark.parametrize("version,inside", [(compat.SUPPORTED[0], True), (compat.SUPPORTED[1], True),
                                            ("0.19.8+abc123", True), ("0.18.9", False), ("0.19.9", False),
                                            ("0.20.0", False), ("1.0.0", False)])
def test_window(version, inside):
    assert compat.in_window(version) is inside


def test_installed_deepspeed_is_inside_the_window():
    assert compat.in_window(), f"the test environment runs DeepSpeed {compat.installed_version()}"
    compat.check_deepspeed()  # no error


def test_outside_the_window_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda: "0.20.1")
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    with pytest.raises(compat.UnsupportedDeepSpeed) as info:
        compat.check_deepspeed()
    msg = str(info.value)
    assert "0.20.1" in msg and compat.SUPPORTED[0] in msg and compat.SUPPORTED[1] in msg and compat.ALLOW_ENV in msg


def test_outside_the_window_runs_with_the_switch_and_fast_paths_off(monkeypatch, caplog):
    monkeypatch.setattr(compat, "installed_version", lambda: "0.20.1")
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="deepspeed_multi.compat"):
        compat.check_deepspeed()
    assert "outside the supported window" in caplog.text
    assert not compat.fast_paths_allowed()
    assert not stage12_reduce.install(_fake_z12())


def test_a_missing_critical_method_is_refused_even_with_the_switch(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda: "0.20.1")
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    monkeypatch.delattr(ZeROOptimizer, "clear_backward_seen_flag")
    with pytest.raises(compat.UnsupportedDeepSpeed, match="ZeROOptimizer.clear_backward_seen_flag"):
        compat.check_deepspeed()


def test_every_critical_touch_point_is_present_in_the_installed_deepspeed():
    assert compat.missing_critical() == []


# ------------------------------------------------------------------ fixes for supported releases
class _Work:
    def __init__(self, log, i):
        self.log, self.i = log, i

    def wait(self):
        self.log.append(("wait", self.i))


def test_the_gather_fix_is_installed_before_0_19_8_only_and_waits_on_each_gather(monkeypatch):
    """[Note: fixes for supported releases]: before 0.19.8 each of _allgather_params_coalesced's
    async all-gathers is waited on as it is launched (0.19.4-0.19.7 waited on the last only)."""
    from deepspeed.runtime.zero import partition_parameters as pp
    log = []

    class FakeComm:
        def all_gather_into_tensor(self, out, inp, group=None, async_op=False):
            log.append(("launch", len(log)))
            return _Work(log, len(log) - 1)

        def get_rank(self):
            return 0

    def coalesced(self, param_list, hierarchy=0, quantize=False):  # 0.19.7's shape: wait on the last only
        handles = [pp.dist.all_gather_into_tensor(None, None, async_op=True) for _ in param_list]
        handles[-1].wait()
        return pp.dist.get_rank()

    monkeypatch.setattr(pp, "dist", FakeComm())
    monkeypatch.setattr(pp.Init, "_allgather_params_coalesced", coalesced)
    assert compat.apply_fixes("0.19.8") == [] and pp.Init._allgather_params_coalesced is coalesced
    assert compat.apply_fixes("0.19.5") and compat.apply_fixes("0.19.4")  # idempotent
    fixed = pp.Init._allgather_params_coalesced
    assert fixed is not coalesced and fixed.__wrapped__ is coalesced
    assert fixed(None, [1, 2, 3]) == 0
    assert log == [("launch", 0), ("wait", 0), ("launch", 2), ("wait", 2), ("launch", 4), ("wait", 4), ("wait", 4)]
    assert isinstance(pp.dist, FakeComm), "the module's comm is put back after the call"


# --------------------------------------------------------------------- the exact-method check
def _fake_z12(cls=DeepSpeedZeroOptimizer):
    return fake(cls, cpu_offload=False, zenflow=False)


def test_fast_paths_are_allowed_exactly_where_the_installed_sources_were_checked():
    """On the newest supported DeepSpeed every fast-path method is a checked source (a new release
    needs its sources checked and added: python -m deepspeed_multi.compat --sources); on an older
    one in the window, each fast path is allowed exactly when all of its methods are."""
    found = compat.checked_sources_of_installed()
    unchecked = {key for key, h in found.items() if h not in compat.CHECKED_SOURCES.get(key, ())}
    if compat.installed_version().startswith(compat.SUPPORTED[1]):
        assert not unchecked, f"never checked: {sorted(unchecked)}"
    for feature, (owner, names) in compat.FAST_PATH_METHODS.items():
        cls = compat._class(owner)
        expected = not any(f"{owner}.{n}" in unchecked for n in names)
        assert all(compat._unchanged(cls, n) for n in names) == expected, feature


def test_a_changed_method_turns_its_fast_path_off_with_one_warning(monkeypatch, caplog):
    before = stage12_reduce.install(_fake_z12())
    if compat.installed_version().startswith(compat.SUPPORTED[1]):
        assert before, "the checked DeepSpeed must take the fast path"
    original = DeepSpeedZeroOptimizer.allreduce_and_copy_with_multiple_ranks

    def edited(self, *args, **kwargs):  # stands in for a DeepSpeed release that edited it
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "allreduce_and_copy_with_multiple_ranks", edited)
    compat._warned.clear()
    caplog.clear()  # (an older DeepSpeed warned about its own method above)
    with caplog.at_level(logging.WARNING, logger="deepspeed_multi.compat"):
        assert not stage12_reduce.install(_fake_z12())
        assert not stage12_reduce.install(_fake_z12())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "stage12_reduce" in lines[0] and "allreduce_and_copy_with_multiple_ranks" in lines[0]
    monkeypatch.undo()
    assert stage12_reduce.install(_fake_z12()) == before  # DeepSpeed's own method again


def test_an_override_is_left_alone_silently(caplog):

    class Custom(DeepSpeedZeroOptimizer):

        def allreduce_and_copy_with_multiple_ranks(self, *args, **kwargs):
            return None

    opt = _fake_z12(Custom)
    with caplog.at_level(logging.WARNING, logger="deepspeed_multi.compat"):
        assert not stage12_reduce.install(opt)
    assert not caplog.records


# ------------------------------------------------------------------------ the replacement registry
class _Thing:

    def hello(self):
        return "deepspeed"


def test_replace_original_restore():
    thing = _Thing()
    compat.replace_method(thing, "hello", lambda self: "ours+" + compat.original(self, "hello")(), "feature_a")
    assert thing.hello() == "ours+deepspeed" and compat.installed(thing, "feature_a")
    with pytest.raises(RuntimeError, match="already replaced by feature_a"):
        compat.replace_method(thing, "hello", lambda self: "other", "feature_b")
    compat.restore(thing, "feature_a")
    assert thing.hello() == "deepspeed" and not compat.installed(thing, "feature_a") and "hello" not in vars(thing)


def test_run_before_on_its_own_and_behind_another_feature():
    seen = []
    alone = _Thing()
    compat.run_before(alone, "hello", lambda obj: seen.append(("alone", obj)), "feature_b")
    assert alone.hello() == "deepspeed" and seen == [("alone", alone)] and compat.installed(alone, "feature_b")
    seen.clear()
    behind = _Thing()
    compat.replace_method(behind, "hello", lambda self: seen.append("a") or "ours+" + compat.original(self, "hello")(),
                          "feature_a")
    compat.run_before(behind, "hello", lambda obj: seen.append(("b", obj)), "feature_b")
    assert behind.hello() == "ours+deepspeed" and seen == ["a", ("b", behind)]  # feature_a's first


def test_swapped_restores_on_error():
    import types
    module = types.SimpleNamespace(initialize="deepspeed's")
    with pytest.raises(ValueError):
        with compat.swapped(module, "initialize", "ours"):
            assert module.initialize == "ours"
            raise ValueError
    assert module.initialize == "deepspeed's"


# ------------------------------------------------------------------------- package rules
def _sources():
    return {p: p.read_text() for p in PACKAGE.rglob("*.py")}


def test_no_method_is_replaced_outside_the_compat_layer():
    pattern = re.compile(r"MethodType|_execution_engine|torch\._C\._")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p, text in _sources().items()
                 if p.name not in ("compat.py", "graph.py")
                 for i, line in enumerate(text.splitlines(), 1) if pattern.search(line) and not line.strip().startswith(("#", "``"))]
    assert not offenders, f"bind methods only through compat.replace_method, torch._C only in autograd/graph.py: {offenders}"


def test_fake_optimizers_are_built_in_one_place():
    """Tests build fake ZeRO optimizers only through fake_zero.fake, which checks every attribute it
    sets against the touch-point table: no second list of DeepSpeed's names in the tests."""
    here, needle = Path(__file__).parent, "object.__new__" + "("  # (split, or this file would match itself)
    offenders = [p.name for p in here.rglob("*.py") if p.name != "fake_zero.py" and needle in p.read_text()]
    assert not offenders, offenders


def test_environment_switches_are_read_in_one_place():
    offenders = [str(p.relative_to(ROOT)) for p, text in _sources().items()
                 if p.name != "switches.py" and re.search(r"environ(\.get)?\(?\[?[\"']DSM_", text)]
    assert not offenders


def test_engine_stays_small():
    assert len((PACKAGE / "engine.py").read_text().splitlines()) < 400


def test_design_doc_lists_the_touch_points_as_generated():
    doc = (ROOT / "docs" / "design.md").read_text()
    assert compat.markdown_table() in doc, "regenerate with: python -m deepspeed_multi.compat > the table in docs/design.md"


def test_every_replaced_name_is_a_touch_point():
    replaced = {(tp.owner, tp.name) for tp in compat.TOUCH_POINTS if tp.how in ("replaced", "relied on")}
    listed = {(owner, n) for owner, names in compat.FAST_PATH_METHODS.values() for n in names}
    assert replaced == listed


def test_the_install_files_test_both_ends_of_each_supported_window():
    """compat.SUPPORTED and transformers.TESTED are what the code accepts; pyproject.toml, requirements-test.txt
    (the newest environment) and the Makefile's oldest environment must install those ends, or make test
    would stop testing what users are allowed to run. The torch make test installs must be in pyproject.toml's
    range (its ends were measured by hand: docs/supported_releases.md)."""
    root = Path(__file__).resolve().parents[2]
    pins = dict(re.findall(r"^(deepspeed|transformers)==(\S+)$", (root / "requirements-test.txt").read_text(), re.M))
    make = dict(re.findall(r"^(DS_OLDEST|TRANSFORMERS_OLDEST) \?= (\S+)$", (root / "Makefile").read_text(), re.M))
    setup = (root / "pyproject.toml").read_text()
    assert (make["DS_OLDEST"], pins["deepspeed"]) == compat.SUPPORTED
    assert f'"deepspeed>={compat.SUPPORTED[0]},<={compat.SUPPORTED[1]}"' in setup
    tested = pytest.importorskip("deepspeed_multi.transformers").TESTED["transformers"]
    minor = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    assert (minor(make["TRANSFORMERS_OLDEST"]), minor(pins["transformers"])) == (tested[0], tested[-1])
    major, last = tested[-1].split(".")
    assert f'"transformers>={tested[0]}.0,<{major}.{int(last) + 1}"' in setup
    # torch: make test runs one release (the Makefile's pin); it must lie in the range pyproject.toml states.
    torch_pin = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (root / "Makefile").read_text(), re.M).group(1)
    low, high = re.search(r'"torch>=(\S+?),<(\S+?)"', setup).groups()
    assert compat._version_tuple(low) <= compat._version_tuple(torch_pin) < compat._version_tuple(high), \
        (torch_pin, low, high)
