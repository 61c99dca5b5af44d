"""Programs run on simulated nodes (tests/multi_gpu/nodes.py; test_nodes.py starts them).

Each program is one launch of every node and runs several checks in sequence (a launch costs
imports and a rendezvous); each takes the ``disk`` keyword: the path where every node sees its
own disk (or the one shared disk).
"""
import os

import torch

import deepspeed.comm as dist
from common import compare, run_engines, run_reference
import scenarios


def local_world():
    return int(os.environ["LOCAL_WORLD_SIZE"])


def _zero(scenario, name, **zero):
    scenario.members[name].config["zero_optimization"].update(zero)
    return scenario


def _hpz_beside_zero2():
    """A ZeRO-3 engine whose secondary partition (hpZ) spans one node's ranks, after a ZeRO-2 engine in one loss."""
    return _zero(scenarios._chain(2, 3, 2, 2), "b", zero_hpz_partition_size=local_world())


def _mics_beside_zero2():
    """A MiCS engine (ZeRO-3 sharded within each node, replicated across nodes) after a ZeRO-2 engine in one loss."""
    return _zero(scenarios._chain(2, 3, 2, 2), "b", mics_shard_size=local_world())


ROWS = {
    "chain-z2z3-gas22": lambda: scenarios.SCENARIOS["chain-z2z3-gas22"](),
    "chain-z3z1-gas31": lambda: scenarios.SCENARIOS["chain-z3z1-gas31"](),
    "rlhf-4-engines": lambda: scenarios.SCENARIOS["rlhf-4-engines"](),
    "hpz-z3-beside-z2-gas22": _hpz_beside_zero2,
    "mics-z3-beside-z2-gas22": _mics_beside_zero2,
}


def _took_effect(name, engines):
    b = engines.get("b")
    if name.startswith("hpz"):
        assert b.zero_hpz_partition_size() == local_world(), b.zero_hpz_partition_size()
    if name.startswith("mics"):
        from deepspeed.runtime.zero.mics import MiCS_Optimizer
        assert isinstance(b.optimizer, MiCS_Optimizer), type(b.optimizer)


def exact_rows(names, disk=None):
    """Each row through engines on every rank and through plain PyTorch on the same global batch:
    returns {row: {engine: max abs error}} (fp32; compare() raises above 1e-5)."""
    import deepspeed_multi
    out = {}
    for name in names:
        scenario = ROWS[name]()
        assert scenario.world_size == dist.get_world_size(), (name, scenario.world_size)
        try:
            engines = run_engines(scenario, deepspeed_multi.initialize)
            _took_effect(name, engines)
            out[name] = compare(engines, run_reference(scenario), scenario.members, scenario.dtype)
        except Exception as e:
            raise AssertionError(f"row {name!r} on {dist.get_world_size()} ranks: {type(e).__name__}: {e}") from e
        for e in engines.values():
            e.destroy()
        del engines
        import gc
        gc.collect()
    return out
