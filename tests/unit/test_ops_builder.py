"""JIT loader errors, the DSM_FUSED_REDUCE switch, the prebuild command and the nvcc compile check."""
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from deepspeed_multi.ops import builder, fused_reduce, reference
from _toolchain import skip_unless_toolchain_missing


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty in-process caches and a private build dir; restored afterwards."""
    monkeypatch.setattr(builder, "_cache", {})
    monkeypatch.setenv("DSM_BUILD_DIR", str(tmp_path / "build"))
    fused_reduce._reset_for_tests()
    yield tmp_path
    fused_reduce._reset_for_tests()


def test_missing_compiler_is_reported_with_the_fix(fresh, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/bin/g++-missing")
    with pytest.raises(builder.BuildError, match=r"g\+\+-missing.*not found.*install.*reference"):
        builder.load()
    # the failure is cached: reported once, not rebuilt on every call
    monkeypatch.setattr(builder, "_build", lambda *a: pytest.fail("rebuilt after a cached failure"))
    with pytest.raises(builder.BuildError):
        builder.load()


def test_missing_ninja_is_reported(fresh, monkeypatch):
    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(builder.BuildError, match=r"ninja.*pip install ninja.*reference"):
        builder.load()


def test_compile_failure_is_wrapped(fresh, monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("Error building extension 'dsm_fused_reduce'")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    with pytest.raises(builder.BuildError, match=r"failed: Error building.*--verbose.*reference"):
        builder.load()


def test_build_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("DSM_BUILD_DIR", raising=False)
    default = builder.build_dir(cuda=False)
    assert default.parts[-4:-1] == (".cache", "deepspeed_multi", torch.__version__.replace("+", "_"))
    assert default.name == f"dsm_fused_reduce-{builder.build_key(cuda=False)}"
    monkeypatch.setenv("DSM_BUILD_DIR", str(tmp_path))
    assert builder.build_dir(cuda=False) == tmp_path


def test_env_switch(fresh, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=fused_reduce.__name__)
    monkeypatch.setenv("DSM_FUSED_REDUCE", "ref")
    assert fused_reduce.active_backend() == "ref"
    assert "ref backend" in caplog.text

    fused_reduce._reset_for_tests()
    monkeypatch.setenv("DSM_FUSED_REDUCE", "bogus")
    with pytest.raises(ValueError, match=r"DSM_FUSED_REDUCE='bogus'.*auto, ext, ref"):
        fused_reduce.active_backend()

    def unavailable(verbose=False):
        raise builder.BuildError("no compiler")

    monkeypatch.setattr(builder, "load", unavailable)
    fused_reduce._reset_for_tests()
    monkeypatch.setenv("DSM_FUSED_REDUCE", "auto")
    assert fused_reduce.active_backend() == "ref"
    assert "extension is unavailable: no compiler" in caplog.text
    out = torch.empty(3)
    assert fused_reduce.pack([torch.ones(3)], out, 2.0).item() == 0.0 and out.tolist() == [2.0] * 3

    fused_reduce._reset_for_tests()
    monkeypatch.setenv("DSM_FUSED_REDUCE", "ext")
    with pytest.raises(builder.BuildError, match="no compiler"):
        fused_reduce.active_backend()


def test_env_switch_selects_the_extension(monkeypatch):
    try:
        module = builder.load()
    except builder.BuildError as exc:
        skip_unless_toolchain_missing(exc)
    for mode in ("ext", "auto"):
        fused_reduce._reset_for_tests()
        monkeypatch.setenv("DSM_FUSED_REDUCE", mode)
        assert fused_reduce.active_backend() == "ext"
        assert fused_reduce._impl is module
    fused_reduce._reset_for_tests()
    from deepspeed_multi.ops import active_backend, pack, unpack_accumulate  # the public API

    assert callable(pack) and callable(unpack_accumulate) and active_backend() in ("ext", "ref")
    fused_reduce._reset_for_tests()


def test_prebuild_command(capsys):
    from deepspeed_multi.ops import build

    try:
        builder.load()
    except builder.BuildError:
        assert build.main([]) == 1
        return
    assert build.main([]) == 0
    printed = capsys.readouterr().out
    assert "built dsm_fused_reduce" in printed and "module:" in printed


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    from torch.utils.cpp_extension import include_paths

    csrc = builder.CSRC
    cmd = ["nvcc", "-std=c++17", "-O3", f"-I{csrc}", *[f"-I{p}" for p in include_paths()],
           "-c", str(csrc / "fused_reduce_cuda.cu"), "-o", str(tmp_path / "fused_reduce_cuda.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "fused_reduce_cuda.o").stat().st_size > 0


def _env_with_build_dir(directory, **extra):
    env = dict(os.environ, DSM_BUILD_DIR=str(directory), **extra)
    root = Path(builder.__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    return env


def test_a_build_killed_midway_is_taken_over_by_two_concurrent_builds(tmp_path):
    """A rank killed while it built leaves torch's 'lock' file behind (torch would wait on it
    forever); the next processes say what happened and build, once, both importing the result."""
    try:
        builder.check_toolchain()
    except builder.BuildError as exc:
        skip_unless_toolchain_missing(exc)
    directory = tmp_path / "build"
    env = _env_with_build_dir(directory)
    killed = subprocess.Popen([sys.executable, "-c", "from deepspeed_multi.ops import builder; builder.load()"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while not (directory / builder.TORCH_LOCK_NAME).exists():
        assert killed.poll() is None, killed.stderr.read()
        assert time.monotonic() < deadline, "the build never took torch's lock"
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    assert (directory / builder.TORCH_LOCK_NAME).exists()  # what the killed build left behind

    script = textwrap.dedent(
        """
        import torch
        from deepspeed_multi.ops import builder
        out = torch.empty(4)
        assert builder.load().pack([torch.ones(4)], out, 3.0).item() == 0.0
        assert out.tolist() == [3.0] * 4
        print("ok")
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and "ok" in out, err
        errs.append(err)
    said = "".join(errs)
    assert said.count("removing") == 1 and "killed" in said, said
    assert said.count("building the fused-reduce extension") == 1, said


def test_a_waiting_process_says_what_it_waits_on(tmp_path):
    directory = tmp_path / "build"
    directory.mkdir()
    with open(directory / builder.LOCK_NAME, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on host elsewhere\n")
        held.flush()
        script = ("import pathlib; from deepspeed_multi.ops import builder\n"
                  f"with builder.build_lock(pathlib.Path({str(directory)!r})): print('got it')")
        waiter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=_env_with_build_dir(directory, DSM_BUILD_WAIT_REPORT_SECONDS="0.5"))
        first = waiter.stderr.readline()  # blocks until the waiter reports (or dies: '')
        assert waiter.poll() is None, "took a lock that another process holds"
        fcntl.flock(held, fcntl.LOCK_UN)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and "got it" in out, first + err
    assert "waiting" in first and "pid 4242 on host elsewhere" in first and "delete" in first, first + err


def test_build_dirs_differ_by_environment_and_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("DSM_BUILD_DIR", raising=False)
    here = builder.build_dir(cuda=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    other_env = builder.build_dir(cuda=False)
    monkeypatch.undo()
    monkeypatch.delenv("DSM_BUILD_DIR", raising=False)
    checkout = tmp_path / "checkout" / "csrc"
    shutil.copytree(builder.CSRC, checkout)
    monkeypatch.setattr(builder, "CSRC", checkout)
    other_checkout = builder.build_dir(cuda=False)
    (checkout / builder.CPU_SOURCES[0]).write_text((checkout / builder.CPU_SOURCES[0]).read_text() + "\n// edited\n")
    edited = builder.build_dir(cuda=False)
    assert len({here, other_env, other_checkout, edited}) == 4


def test_reference_flag_propagates_nan_and_inf():
    for bad in (float("nan"), float("inf")):
        t = torch.ones(10)
        t[5] = bad
        assert reference.unpack_accumulate(t, [torch.zeros(10)], 1.0, False).item() == 1.0
