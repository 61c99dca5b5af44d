"""Swap ``deepspeed.initialize`` for ``deepspeed_multi.initialize`` in every Python process of a run.

A harness (tools/deepspeed_suite/run.py, tools/peer_programs/run.py) puts this directory first on
PYTHONPATH, so every process of the run (pytest and its workers, the ranks a launcher spawns)
imports this file at start-up. With DSM_DROP_IN_SIDE=ours, ``deepspeed.initialize`` becomes
``deepspeed_multi.initialize`` as ``deepspeed`` finishes importing (before any module binds it);
with DSM_DROP_IN_SIDE=upstream it stays DeepSpeed's. Without DSM_DROP_IN_SIDE this file does nothing.

Each process appends lines to DSM_DROP_IN_LOG (side, kind, what, pid, test), read back by
:func:`read_log`: ``engine <class>`` for each engine built, ``swap armed`` when ``deepspeed`` was
imported and patched, ``swap missed`` at exit when ``deepspeed`` was imported but never patched.
A harness asserts from them that the swap reached every process that built an engine.

[Note: the finder stays until deepspeed runs]
The finder patches the loader of the spec it returns and leaves ``sys.meta_path`` only once that
loader has executed ``deepspeed``. ``importlib.util.find_spec("deepspeed")`` (Transformers and
Accelerate ask it to see whether DeepSpeed is installed) gets a patched spec that is never
executed; the import that follows asks the finder again. It finds the spec with the finders
after it on ``sys.meta_path``, never through ``importlib.util.find_spec`` (which would ask it).
"""
import atexit
import os
import sys

_SIDE = os.environ.get("DSM_DROP_IN_SIDE")
_patched = []


def _log(kind, what):
    path = os.environ.get("DSM_DROP_IN_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
    line = f"{_SIDE}\t{kind}\t{what}\t{os.getpid()}\t{test}\n"
    with open(path, "a") as f:  # one short append per line: lines from concurrent ranks stay whole
        f.write(line)


def _patch(deepspeed):
    import functools
    import threading

    upstream = deepspeed.initialize
    inside = threading.local()

    @functools.wraps(upstream)
    def initialize(*args, **kwargs):
        # deepspeed_multi.initialize calls deepspeed.initialize itself: that inner call is upstream's.
        if getattr(inside, "active", False):
            return upstream(*args, **kwargs)
        if _SIDE == "ours":
            import deepspeed_multi
            build = deepspeed_multi.initialize
        else:
            build = upstream
        inside.active = True
        try:
            out = build(*args, **kwargs)
        finally:
            inside.active = False
        _log("engine", f"{type(out[0]).__module__}.{type(out[0]).__name__}")
        return out

    initialize.dsm_drop_in_side = _SIDE  # what a harness (and a test) checks
    deepspeed.initialize = initialize
    _patched.append(True)
    _log("swap", "armed")


def spec_then(finder, name, path, target, after):
    """The spec the finders after ``finder`` on ``sys.meta_path`` give for ``name``, its loader calling
    ``after(module)`` once the module has executed (a meta-path finder's ``find_spec`` that patches a module as
    it is imported; never through ``importlib.util.find_spec``, which would ask ``finder`` again)."""
    spec = None
    for other in sys.meta_path:
        if other is not finder and hasattr(other, "find_spec"):
            spec = other.find_spec(name, path, target)
            if spec is not None:
                break
    if spec is None or spec.loader is None:
        return spec
    exec_module = spec.loader.exec_module

    def exec_and_patch(module):
        exec_module(module)
        after(module)

    spec.loader.exec_module = exec_and_patch
    return spec


class _PatchOnImport:
    """Meta-path finder: ``deepspeed`` imports as usual, then is patched before anyone uses it."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None

        def patch_and_leave(module):
            _patch(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        return spec_then(self, name, path, target, patch_and_leave)


def _at_exit():
    if "deepspeed" in sys.modules and not _patched:
        _log("swap", "missed")


def read_log(path):
    """``{"engines": Counter(class -> count), "armed": {pid}, "missed": {pid}, "built_by": {pid}}``."""
    import collections
    found = {"engines": collections.Counter(), "armed": set(), "missed": set(), "built_by": set()}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 5:
                    continue
                _, kind, what, pid, _ = parts
                if kind == "engine":
                    found["engines"][what] += 1
                    found["built_by"].add(pid)
                elif kind == "swap":
                    found[what].add(pid)
    return found


if _SIDE in ("upstream", "ours"):
    sys.meta_path.insert(0, _PatchOnImport())
    atexit.register(_at_exit)
