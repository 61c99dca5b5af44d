"""pytest plugin (``-p suite_select``): keep only the tests under the node ids in DSM_SUITE_SELECT.

run.py passes whole files to pytest and the selected classes here: node ids of classes given on
pytest-xdist's command line collected no item at all with DeepSpeed's conftest.
"""
import os


def pytest_collection_modifyitems(config, items):
    wanted = [w for w in os.environ.get("DSM_SUITE_SELECT", "").split("\n") if w]
    if not wanted:
        return
    keep = [i for i in items if any(i.nodeid == w or i.nodeid.startswith(w + "[")  # a test's parametrizations
                                    or i.nodeid.startswith(w.rstrip("/") + ("/" if w.endswith("/") else "::"))
                                    for w in wanted)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep
