"""JIT loader for the fused-reduce C++/CUDA extension (a tiny DeepSpeed ``op_builder``).

``load()`` compiles ``<repo root>/csrc/fused_reduce.cpp`` (plus ``fused_reduce_cuda.cu`` when
``torch.cuda.is_available()`` and ``nvcc`` is found) with ``torch.utils.cpp_extension.load`` and
returns the module. It is cached

* in-process: the first successful ``load()`` is reused (a failure is cached too, so a missing
  compiler is reported once, not on every call);
* on disk: ``$DSM_BUILD_DIR`` if set, else
  ``~/.cache/deepspeed_multi/<torch version>/<name>-<key>``, the key a hash of the Python
  environment (``sys.prefix``) and of the sources' path and contents, so that two environments or
  two checkouts never build into (and overwrite) one directory.

[Note: the build lock]
Several ranks (on one node, or on nodes sharing a home directory) call ``load()`` at once. They
meet on ``dsm.lock`` in the build directory, an ``flock``: the kernel drops it when its holder dies,
so a build killed midway never leaves the next process waiting on a dead owner. The holder then
builds; torch's loader has a lock of its own (a ``lock`` file it deletes when done), which a killed
build leaves behind and on which torch would wait forever: whoever holds ``dsm.lock`` knows no live
build of ours is running, so such a file is stale and is removed (saying so). A waiter says every
few seconds what it waits on, and who holds it; the holder says that it is building (tens of
seconds on first use).

If ninja or the C++ compiler is missing, or compilation fails, ``load()`` raises
:class:`BuildError` whose message says what is missing and how to fix it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from ..switches import BUILD_DIR, BUILD_WAIT_REPORT_SECONDS
from ..switches import value as _switch_value

# The sources: inside the package for a regular install (setup.py copies them), else the
# repository's csrc/ (editable install, as `make setup` does).
CSRC = next((p for p in (Path(__file__).resolve().parents[1] / "csrc", Path(__file__).resolve().parents[2] / "csrc")
             if p.is_dir()), Path(__file__).resolve().parents[2] / "csrc")
CPU_SOURCES = ("fused_reduce.cpp",)
CUDA_SOURCES = ("fused_reduce_cuda.cu",)
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]  # no -march=native: the cache may be shared
CUDA_CFLAGS = ["-O3", "-std=c++17"]

FALLBACK_NOTE = "the pure-PyTorch reference (deepspeed_multi.ops.reference) is used instead"

_lock = threading.Lock()
_cache: dict[str, object] = {}

LOCK_NAME = "dsm.lock"
TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton


class BuildError(RuntimeError):
    """The extension could not be built; the message says why and how to fix it."""


def with_cuda() -> bool:
    """True when the CUDA kernels are to be compiled (a GPU is visible and nvcc exists)."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


def extension_name(cuda: bool) -> str:
    return "dsm_fused_reduce_cuda" if cuda else "dsm_fused_reduce"


def build_dir(cuda: bool) -> Path:
    """Where the build lives: ``$DSM_BUILD_DIR`` or ``~/.cache/deepspeed_multi/<torch>/<name>``."""
    override = _switch_value(BUILD_DIR)
    if override:
        return Path(override).expanduser()
    version = torch.__version__.replace("+", "_")
    return Path.home() / ".cache" / "deepspeed_multi" / version / f"{extension_name(cuda)}-{build_key(cuda)}"


def build_key(cuda: bool) -> str:
    """What makes one build differ from another beyond torch's version: the environment, the
    sources (their path, so two checkouts differ; their bytes) and the flags."""
    digest = hashlib.sha256()
    for part in (sys.prefix, str(CSRC), repr(CFLAGS), repr(CUDA_CFLAGS), str(cuda)):
        digest.update(part.encode() + b"\0")
    for source in CPU_SOURCES + (CUDA_SOURCES if cuda else ()):
        path = CSRC / source
        digest.update(path.read_bytes() if path.exists() else b"missing")
    return digest.hexdigest()[:12]


def _say(message: str) -> None:
    print(f"deepspeed_multi: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold ``dsm.lock`` in ``directory`` (see [Note: the build lock]); report while waiting."""
    path = directory / LOCK_NAME
    with open(path, "a+") as handle:
        started = time.monotonic()
        next_report = max(float(_switch_value(BUILD_WAIT_REPORT_SECONDS, "5")), 0.1)
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited >= next_report:
                    handle.seek(0)
                    holder = handle.read().strip() or "an unknown process"
                    _say(f"waiting {waited:.0f}s for the fused-reduce build in {directory} held by "
                         f"{holder}; it takes tens of seconds on first use. If no such process is "
                         f"running (a build on another host sharing this directory that died), "
                         f"delete {path}, or set DSM_BUILD_DIR to a directory of this node's own.")
                    next_report = 2 * next_report
                time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
        try:
            stale = directory / TORCH_LOCK_NAME
            if stale.exists():
                _say(f"removing {stale}, left by a build that was killed (no build holds {path})")
                stale.unlink(missing_ok=True)
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_toolchain() -> None:
    """Raise BuildError if ninja or the C++ compiler (``$CXX`` or ``c++``) is missing."""
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise BuildError(
            f"cannot build the fused-reduce extension: ninja was not found; install it with "
            f"`pip install ninja`; until then {FALLBACK_NOTE}"
        )
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(
            f"cannot build the fused-reduce extension: the C++ compiler {cxx!r} (from $CXX, default "
            f"'c++') was not found on PATH; install one (e.g. `apt-get install g++`) or point $CXX at "
            f"it; until then {FALLBACK_NOTE}"
        )


def load(verbose: bool = False):
    """Build (once) and return the extension module; raise BuildError if that is impossible.

    ``verbose`` shows the compiler commands and output of a build this call performs.
    """
    cuda = with_cuda()
    key = extension_name(cuda)
    with _lock:
        cached = _cache.get(key)
        if cached is None:
            try:
                cached = _build(cuda, verbose)
            except BuildError as exc:
                cached = exc
            _cache[key] = cached
    if isinstance(cached, BuildError):
        raise cached
    return cached


def _build(cuda: bool, verbose: bool):
    check_toolchain()
    from torch.utils.cpp_extension import load as jit_load

    directory = build_dir(cuda)
    directory.mkdir(parents=True, exist_ok=True)
    sources = [str(CSRC / s) for s in CPU_SOURCES + (CUDA_SOURCES if cuda else ())]
    cflags = CFLAGS + (["-DDSM_WITH_CUDA"] if cuda else [])
    try:
        with build_lock(directory):
            if not any(directory.glob(f"{extension_name(cuda)}*.so")):
                _say(f"building the fused-reduce extension in {directory} (first use here; this "
                     f"takes tens of seconds; `python -m deepspeed_multi.ops.build` prebuilds it)")
            return jit_load(
                name=extension_name(cuda),
                sources=sources,
                extra_cflags=cflags,
                extra_cuda_cflags=CUDA_CFLAGS,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC)],
                build_directory=str(directory),
                with_cuda=cuda,
                verbose=verbose,
            )
    except Exception as exc:  # compiler errors surface as RuntimeError/CalledProcessError
        raise BuildError(
            f"building the fused-reduce extension in {directory} failed: {exc}; rerun "
            f"`python -m deepspeed_multi.ops.build --verbose` to see the compiler output; until then "
            f"{FALLBACK_NOTE}"
        ) from exc
