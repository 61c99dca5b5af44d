"""Swap deepspeed.initialize in every Python process of a DeepSpeed unit-test run.

run.py puts this directory first on PYTHONPATH, so every process of the run (pytest, its xdist
workers and forks, the ranks DeepSpeed's DistributedTest spawns) imports this file at start-up.
With DSM_SUITE_SIDE=ours, ``deepspeed.initialize`` becomes ``deepspeed_multi.initialize`` as soon
as ``deepspeed`` is imported (before any test module binds it); with DSM_SUITE_SIDE=upstream it
stays DeepSpeed's. On both sides each engine built appends one line (side, engine class, pid,
test) to DSM_SUITE_LOG, so the report can show that the swap reached the processes that built
engines. Without DSM_SUITE_SIDE this file does nothing.
"""
import os
import sys

_SIDE = os.environ.get("DSM_SUITE_SIDE")


def _log(engine):
    path = os.environ.get("DSM_SUITE_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    line = f"{_SIDE}\t{type(engine).__module__}.{type(engine).__name__}\t{os.getpid()}\t{test}\n"
    with open(path, "a") as f:  # one short append per engine: lines from concurrent ranks stay whole
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
        _log(out[0])
        return out

    deepspeed.initialize = initialize


class _PatchOnImport:
    """Meta-path finder: lets ``deepspeed`` import as usual, then patches it before anyone uses it."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        import importlib.util
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _SIDE in ("upstream", "ours"):
    sys.meta_path.insert(0, _PatchOnImport())
