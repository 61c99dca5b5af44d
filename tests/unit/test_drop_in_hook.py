"""The drop-in hook (tools/drop_in/sitecustomize.py) swaps deepspeed.initialize in a fresh process,
also when something asked importlib.util.find_spec("deepspeed") first (Transformers and Accelerate do,
to see whether DeepSpeed is installed), and logs a process that imported deepspeed without the swap."""
import os
import subprocess
import sys

import pytest

HOOK = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "drop_in")
PROGRAM = """
import importlib.util, sys
{before}
import deepspeed
print("patched" if getattr(deepspeed.initialize, "dsm_drop_in_side", None) else "upstream")
"""


def _run(before, tmp_path, side="ours"):
    log = tmp_path / "log.tsv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(HOOK), os.environ.get("PYTHONPATH", "")]),
               DSM_DROP_IN_SIDE=side, DSM_DROP_IN_LOG=str(log), DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", PROGRAM.format(before=before)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sys.path.insert(0, os.path.abspath(HOOK))
    try:
        from sitecustomize import read_log
    finally:
        sys.path.pop(0)
    return out.stdout.strip().splitlines()[-1], read_log(str(log))


@pytest.mark.parametrize("before", ["", "assert importlib.util.find_spec('deepspeed') is not None",
                                    "import transformers.integrations.deepspeed"])
def test_the_swap_survives_an_earlier_find_spec(before, tmp_path):
    seen, log = _run(before, tmp_path)
    assert seen == "patched"
    assert len(log["armed"]) == 1 and not log["missed"]


def test_a_process_that_imports_deepspeed_unpatched_is_logged(tmp_path):
    # The finder is taken out by hand: the import then runs unpatched, and the exit line says so.
    seen, log = _run("sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_PatchOnImport']",
                     tmp_path)
    assert seen == "upstream"
    assert len(log["missed"]) == 1 and not log["armed"]
