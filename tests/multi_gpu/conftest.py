import os
import sys

# The scenario modules are imported by name in the spawned ranks, too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


# [Note: tests grouped by the pool's world size]
# The ranks are one pool for the whole session (harness.py); a test on another number of ranks closes
# it and starts one of that size, and the next 2-rank test starts 2 again: each start is the spawn, the
# imports and the process group (4-10 s on 2 cores). So the tests on other numbers of ranks run last,
# grouped by size, one start per size. A test that changes size inside itself (the resize) stays put.
OTHER_POOL_SIZES = {"test_rfc_ppo_four_models": 4, "test_bad_config_and_pipeline_refused": 1}


def _pool_size(item):
    if "world3" in getattr(getattr(item, "callspec", None), "id", ""):
        return 3
    return OTHER_POOL_SIZES.get(item.originalname if hasattr(item, "originalname") else item.name, 2)


def pytest_collection_modifyitems(session, config, items):
    order = {2: 0, 4: 1, 3: 2, 1: 3}
    items.sort(key=lambda item: order[_pool_size(item)] if "multi_gpu" in str(item.fspath) else 0)
