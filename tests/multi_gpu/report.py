"""Print the correctness matrix for deepspeed_multi and for upstream deepspeed.initialize side by side.

    python tests/multi_gpu/report.py [regex] [--only ours|upstream] [--json out.json]

Not collected by pytest (the matrix itself is test_matrix.py). Each scenario group runs in one set
of processes; an upstream scenario that raises is reported with its error, one that hangs ends its
group at the deadline (the rest of that group is reported as not run).
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scenarios  # noqa: E402
from harness import run_distributed  # noqa: E402


def print_table(first, columns, table, cell, json_path=None):
    """A markdown table ``first | column... `` with one row per ``table`` entry (``cell(row, column)``
    per cell), printed; ``table`` also written to ``json_path`` as JSON when given."""
    print(f"| {first} | " + " | ".join(title for title, _ in columns) + " |\n|" + " --- |" * (len(columns) + 1))
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(cell(row, key) for _, key in columns) + " |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(table, f, indent=1)


def _summary(report):
    parts = []
    for name, value in report.items():
        if isinstance(value, tuple) or isinstance(value, list):
            parts.append(f"{name}: cos {value[0]:.4f}, norm {value[1]:.3f}")
        elif isinstance(value, str):
            parts.append(value[:80])
        else:
            parts.append(f"{name}: {value:.1e}")
    return "; ".join(parts)


def _run_group(names, which, out_path):
    import deepspeed
    import deepspeed.comm as dist
    initialize = deepspeed.initialize if which == "upstream" else None
    results = {}
    for name in names:
        try:
            rep = scenarios.check(name, initialize=initialize)
            results[name] = "ok: " + _summary(rep)
        except Exception as e:  # noqa: BLE001 - every failure is a row of the report
            msg = str(e).splitlines()[0] if str(e) else ""
            results[name] = f"FAIL {type(e).__name__}: {msg[:160]}"
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("pattern", nargs="?", default=".")
    parser.add_argument("--only", choices=["ours", "upstream"])
    parser.add_argument("--json")
    args = parser.parse_args()
    table = {}
    for which in [w for w in ("ours", "upstream") if args.only in (None, w)]:
        for group, names in scenarios.groups().items():
            names = [n for n in names if re.search(args.pattern, n)]
            if not names:
                continue
            out = tempfile.mktemp(suffix=".json")
            start = time.time()
            try:
                run_distributed(_run_group, names, which, out, world_size=scenarios.SCENARIOS[names[0]]().world_size,
                                timeout_s=60 + 25 * len(names))
            except AssertionError as e:
                print(f"[{which}] group {group} ended early: {str(e).splitlines()[0][:200]}", file=sys.stderr)
            done = json.load(open(out)) if os.path.exists(out) else {}
            for n in names:
                table.setdefault(n, {})[which] = done.get(n, "not run (an earlier scenario of its group hung)")
            print(f"[{which}] {group}: {len(done)}/{len(names)} in {time.time() - start:.0f}s", file=sys.stderr)
    print_table("scenario", [("upstream", "upstream"), ("deepspeed_multi", "ours")], table,
                lambda row, key: str(row.get(key, "")), args.json)


if __name__ == "__main__":
    main()
