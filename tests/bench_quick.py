"""`make bench QUICK=1` end to end, then the renderer over what it wrote: `make test-bench` (about 5 minutes on
2 cores, so not part of `make test`; the name keeps it out of `pytest tests`, which collects test_*.py only).

The short run (fewer steps, smaller sizes, no memory runs) writes benchmarks/results/quick/ and its own
PERFORMANCE.md there, never over the committed results. Checked here: the run exits 0, every claim of the
report has its section, every CPU claim holds figures read from that run's JSON files (the GPU sections
say "not measured" on a machine without one), and every number printed was read from a JSON file.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_report as R  # noqa: E402

QUICK = ROOT / "benchmarks" / "results" / "quick"
GPU_ONLY = {"A Llama on one GPU: ours against upstream"}


def test_make_bench_quick_renders_every_section():
    started = time.monotonic()
    env = dict(os.environ, QUICK="1", PYTHON=sys.executable)
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_all.sh")], cwd=ROOT, env=env, timeout=1800,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    took = time.monotonic() - started
    print(f"make bench QUICK=1: {took / 60:.1f} min, rc {run.returncode}")
    assert run.returncode == 0, run.stdout[-6000:]
    report = R.Report(QUICK, QUICK)
    text = report.render()
    assert text == (QUICK / "PERFORMANCE.md").read_text(), "the quick run's report is not the rendering of its results"
    found = R.sections(text)
    for claim in R.CLAIMS:
        assert claim in found, f"no section {claim!r}"
        if claim not in GPU_ONLY:
            assert R.numbers(found[claim]), f"{claim}: no figure from the quick run:\n{found[claim]}"
    for title, body in found.items():
        untraced = set(R.numbers(title + body)) - report.figures.get(title, set())
        assert not untraced, f"section {title!r} prints numbers not read from a JSON: {sorted(untraced)}"
    # The plots come from the benchmarks themselves (matplotlib, installed by `make bench`): a run without them
    # would render a report with no figure drawn and nothing failing.
    drawn = {p.stem for p in QUICK.glob("*.png")}
    assert {"overhead", "two_engines", "parts", "growth", "counts"} <= drawn, f"plots written: {sorted(drawn)}"
