"""Run the Accelerate loops through deepspeed_multi.accelerate.Accelerator and plain accelerate.Accelerator
and print them side by side (the loop table of docs/accelerate.md, docs/accelerate_loops.md).

    python tests/multi_gpu/report_accelerate.py [--json out.json]

Not collected by pytest: test_accelerate.py runs our side of the same loops. Here every loop also
runs through plain Accelerate in the same processes (DSM_RECORD_UPSTREAM=1), which is recorded:
its error, or its max abs parameter error vs plain PyTorch on the same global batch, whether a
trained model never moved, and at how many steps its learning rate differed from the reference's.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import accelerate_checks as checks  # noqa: E402
from rank_launcher import run_ranks  # noqa: E402
from harness import _allow_fp16_on_cpu  # noqa: E402
from report import print_table  # noqa: E402

GROUPS = [(checks.loops_distill_gan, 2), (checks.loops_encoder_llm, 2), (checks.loop_rfc, 4)]


def _fmt_errors(errors):
    return ", ".join(f"{n} {e:.1e}" for n, e in errors.items())


def _cell(entry, ours):
    if entry is None:
        return "not run"
    if "error" in entry:
        return entry["error"]
    text = "max abs error: " + _fmt_errors(entry["errors"])
    if ours:
        return text + "; LR checked after every step"
    notes = []
    if entry.get("never_updated"):
        notes.append(f"never updated: {', '.join(entry['never_updated'])}")
    if entry.get("lr_mismatch"):
        notes.append("LR differs at " + ", ".join(f"{n}: {k} steps" for n, k in entry["lr_mismatch"].items()))
    return text + ("; " + "; ".join(notes) if notes else "")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ["DSM_RECORD_UPSTREAM"] = "1"      # inherited by the spawned ranks
    table = {}
    for fn, world in GROUPS:
        start = time.time()
        outs = run_ranks(fn, world_size=world, timeout_s=900, rank_setup=_allow_fp16_on_cpu)
        table.update(outs[0])
        print(f"{fn.__name__}: {time.time() - start:.0f}s", file=sys.stderr)
    print_table("loop", [("plain `accelerate.Accelerator`", "upstream"),
                         ("`deepspeed_multi.accelerate.Accelerator`", "ours")], table,
                lambda row, key: _cell(row.get(key), key == "ours"), args.json)


if __name__ == "__main__":
    main()
