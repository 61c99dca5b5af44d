"""deepspeed_multi.report: the environment report users paste into a bug report."""
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import deepspeed_multi
from deepspeed_multi import report as report_module
from deepspeed_multi import switches

PACKAGE = Path(deepspeed_multi.__file__).resolve().parent
SECTIONS = ("deepspeed_multi", "packages", "accelerator", "fused-reduce op", "fast-path switches", "environment")


def _sections(text):
    found, title = {}, None
    for line in text.splitlines():
        match = re.fullmatch(r"\[(.+)\]", line)
        if match:
            title = match.group(1)
            found[title] = []
        elif title and line.strip():
            found[title].append(line)
    return found


def _package_rows(lines):
    """{package: (installed, window, verdict, note)} from the packages section (columns: 2+ spaces apart)."""
    rows = [re.split(r"\s{2,}", line.strip(), maxsplit=4) for line in lines[1:]]
    return {row[0]: tuple(row[1:]) for row in rows}


def test_the_module_prints_every_section_and_a_verdict_per_package(tmp_path):
    # A peft that fails to import (first on the path, beside the real one's metadata): reported, not raised.
    broken = tmp_path / "broken"
    (broken / "peft").mkdir(parents=True)
    (broken / "peft" / "__init__.py").write_text("raise ImportError('peft is broken here')\n")
    build_dir = tmp_path / "never_built"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(broken), DSM_BUILD_DIR=str(build_dir),
               DSM_ZERO3_GRAD_VIEW="0")
    done = subprocess.run([sys.executable, "-m", "deepspeed_multi.report"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "found in sys.modules" not in done.stderr  # the package does not import its report module itself
    sections = _sections(done.stdout)
    assert list(sections) == list(SECTIONS), done.stdout

    about = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in sections["deepspeed_multi"])
    assert about["version"] == deepspeed_multi.__version__ and about["location"] == str(PACKAGE)

    packages = _package_rows(sections["packages"])
    expected = {dist for dist, _, _ in report_module.PACKAGES
                if dist not in report_module.OPTIONAL_UNLISTED or report_module._installed(dist)}
    assert set(packages) == expected, done.stdout
    for name, (installed, window, verdict, note) in packages.items():
        assert verdict in report_module.VERDICTS, (name, verdict)
        assert window and window != "unknown", (name, note)
    # The installed test environment is inside every window it installs.
    assert packages["deepspeed"][2] == "inside" and packages["torch"][2] == "inside"
    assert "IMPORT FAILS: ImportError: peft is broken here" in packages["peft"][3]

    ops = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in sections["fused-reduce op"])
    assert ops["state"].startswith("never tried") and not build_dir.exists()  # no build without --build
    assert ops["build directory"].startswith(str(build_dir))

    switched = {line.split()[0]: line.split()[1:3] for line in sections["fast-path switches"][1:]}
    assert switched[switches.ZERO3_GRAD_VIEW] == ["'0'", "off"] and switched[switches.FUSED_ZERO] == ["unset", "on"]
    listed = set(switched) | {line.split()[0] for line in sections["environment"][1:]}
    assert set(switches.ALL) <= listed
    assert re.search(r"^\s*DS_ACCELERATOR\s+'cpu'", "\n".join(sections["environment"]), re.M)


@pytest.fixture
def versions(monkeypatch):
    """Pretend versions (report._installed) and skip the optional imports."""
    installed = {}
    real = report_module._installed
    monkeypatch.setattr(report_module, "_installed", lambda dist: installed.get(dist, real(dist)))
    monkeypatch.setattr(report_module, "_try_import", lambda module: None)
    return installed


def _verdicts():
    return {row[0]: row[3] for row in report_module._packages()[1:]}


def test_outside_a_gated_window_is_refused_unless_its_switch_is_on(versions, monkeypatch):
    versions.update(deepspeed="0.20.1", transformers="5.99.0", lightning="2.9.0", peft="0.1.0")
    allow = (switches.ALLOW_UNSUPPORTED_DEEPSPEED, switches.ALLOW_UNTESTED_TRAINERS, switches.ALLOW_UNTESTED_LIGHTNING)
    for env in allow:
        monkeypatch.delenv(env, raising=False)
    verdicts = _verdicts()
    assert (verdicts["deepspeed"], verdicts["transformers"], verdicts["lightning"]) == ("refused",) * 3
    assert verdicts["peft"] == "outside"  # pinned by the extra, never checked at run time
    monkeypatch.setenv(switches.ALLOW_UNSUPPORTED_DEEPSPEED, "1")
    monkeypatch.setenv(switches.ALLOW_UNTESTED_TRAINERS, "1")
    verdicts = _verdicts()
    assert (verdicts["deepspeed"], verdicts["transformers"], verdicts["lightning"]) == ("outside", "outside", "refused")


def test_a_missing_package_is_not_installed(versions, monkeypatch):
    monkeypatch.setattr(report_module, "_installed", lambda dist: None if dist == "trl" else "0")
    assert _verdicts()["trl"] == "not installed"


def test_deepspeed_multi_report_is_callable(versions):
    out = io.StringIO()
    deepspeed_multi.report(file=out)
    assert list(_sections(out.getvalue())) == list(SECTIONS)


def test_every_environment_variable_the_package_reads_is_listed():
    """A name the package reads from os.environ (outside switches.py, whose switches are listed from
    switches.ALL) is in report.ENVIRONMENT, so the report shows its value."""
    listed = {name for name, _ in report_module.ENVIRONMENT}
    read = set()
    for path in PACKAGE.rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.search(r"os\.environ|getenv", line):
                read.update(re.findall(r"[\"']([A-Z][A-Z0-9]*_[A-Z0-9_]+|[A-Z]{3,})[\"']", line))
    read -= set(switches.ALL)
    assert read <= listed, sorted(read - listed)
