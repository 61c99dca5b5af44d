"""benchmarks/render_report.py: the report is rendered from the committed JSON results, every claim has its
section, every number a section prints came from a JSON, and the README's and docs' figures are the report's."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_report as R  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def report():
    rep = R.Report(RESULTS, ROOT / "benchmarks")
    text = rep.render()
    return rep, text


sections = R.sections


def test_every_claim_has_its_section_with_figures(report):
    _, text = report
    found = sections(text)
    for claim in R.CLAIMS:
        assert claim in found, f"no section {claim!r}"
        body = found[claim]
        assert "Not measured" not in body, f"{claim}: a committed result file is missing:\n{body}"
        assert R.numbers(body), f"{claim}: no figure"


def test_every_number_comes_from_a_json(report):
    rep, text = report
    for title, body in sections(text).items():
        untraced = set(R.numbers(title + body)) - rep.figures.get(title, set())
        assert not untraced, f"section {title!r} prints numbers not read from a JSON: {sorted(untraced)}"


def test_ratios_equal_the_benchmarks_own(report):
    """The renderer's paired medians are the ratios each benchmark computed and stored itself."""
    _, text = report
    body = sections(text)["Single-engine overhead against upstream"]
    for row in json.loads((RESULTS / "overhead.json").read_text())["rows"]:
        line = f"| ZeRO-{row['stage']} | {row['dtype']} | {row['upstream_ms']:.1f} | {row['ours_ms']:.1f} | {row['ratio']:.3f} ("
        assert line in body, line
    body = sections(text)["Engines in one loss: against the super-module and DeepSpeed's own engines"]
    for row in json.loads((RESULTS / "growth.json").read_text())["engines"]:
        assert f"{row['ratio']:.3f} (" in body


def test_committed_report_is_the_rendered_one(report):
    _, text = report
    committed = (ROOT / "benchmarks" / "PERFORMANCE.md").read_text()
    assert committed == text, "benchmarks/PERFORMANCE.md differs from what render_report.py makes of the results: " \
                              "run python benchmarks/render_report.py --readme README.md"
    assert len(text.splitlines()) < 500


def test_readme_table_is_the_reports(report):
    rep, _ = report
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(R.README_BEGIN), readme.index(R.README_END) + len(R.README_END)
    assert readme[start:end] == rep.readme_table()


def _linked_paragraphs(path):
    """(anchor, paragraph) for each paragraph (table row) of ``path`` that links into a section of the report."""
    for para in re.split(r"\n\s*\n", path.read_text()):
        units = para.splitlines() if para.lstrip().startswith("|") else [para]  # a table: row by row
        for unit in units:
            for a in re.findall(r"PERFORMANCE\.md#([\w\-]+)", unit):
                yield a, unit


def test_docs_figures_point_at_the_report_and_equal_it(report):
    """A README/docs paragraph linking to a report section quotes only figures that section prints."""
    _, text = report
    by_anchor = {R.anchor(title): body for title, body in sections(text).items()}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for a, para in _linked_paragraphs(path):
            assert a in by_anchor, f"{path.name}: link to #{a}, which is no section of the report"
            if R.README_BEGIN in para:
                continue  # the generated table, checked above
            shown = set(R.numbers(by_anchor[a]))
            quoted = {n for n in R.numbers(para) if "." in n or "," in n}  # measured figures, not counts of things
            assert quoted <= shown, f"{path.name}: figures not in section #{a}: {sorted(quoted - shown)}\n{para}"


def test_no_tracker_numbers_in_user_docs():
    for path in [ROOT / "README.md", ROOT / "benchmarks" / "PERFORMANCE.md", *sorted((ROOT / "docs").glob("*.md"))]:
        hits = re.findall(r"[Ii]ssue [0-9]+", path.read_text())
        assert not hits, f"{path.relative_to(ROOT)}: {hits}"


def test_a_missing_result_renders_as_not_measured(tmp_path):
    (tmp_path / "overhead.json").write_text((RESULTS / "overhead.json").read_text())
    text = R.Report(tmp_path, tmp_path).render()
    found = sections(text)
    assert "Not measured" in found["Distillation"] and not R.numbers(found["Distillation"])
    assert all(claim in found for claim in R.CLAIMS)


def test_deepspeeds_own_engines_render_when_growth_has_them(tmp_path):
    """growth.py --upstream adds each point's upstream step times: the growth table gets their row."""
    data = json.loads((RESULTS / "growth.json").read_text())
    for row in data["engines"]:
        row["upstream"] = row["ours"]
    (tmp_path / "growth.json").write_text(json.dumps(data))
    rep = R.Report(tmp_path, tmp_path)
    body = sections(rep.render())["Engines in one loss: against the super-module and DeepSpeed's own engines"]
    assert "chained, / DeepSpeed's N engines | 1.000 (1.00-1.00)" in body
    assert "own N engines under one loss are not in these results" not in body


def test_a_typed_figure_is_caught(report):
    """The traceability check is not vacuous: a number added by hand to a section is reported."""
    rep, text = report
    text = text.replace("## Distillation\n", "## Distillation\n\nAbout 1.2345 of upstream (0.1234-9.8765).\n")
    assert set(R.numbers(sections(text)["Distillation"])) - rep.figures["Distillation"] == {"1.2345", "0.1234", "9.8765"}


def test_a_run_without_memory_renders(tmp_path):
    """`--no-memory` runs (make bench QUICK=1) leave the memory fields out or None; the watchdog's newer
    JSON names its off variant ``ours_off``."""
    for name in ("two_engines", "distillation", "peers", "parts", "rlhf_step", "overhead_watchdog"):
        data = json.loads((RESULTS / f"{name}.json").read_text())
        for row in data.get("rows", []):
            row.pop("mem_vs_supermodule", None), row.pop("ours_mem_ratio", None)
            row["peak_mb"] = None
            if "ours_watchdog_off" in row.get("raw_ms", {}):
                row["raw_ms"]["ours_off"] = row["raw_ms"].pop("ours_watchdog_off")
        if name == "rlhf_step":
            data["peak_mb"] = {"upstream": None, "ours": None}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    found = sections(R.Report(tmp_path, tmp_path).render())
    two = json.loads((tmp_path / "two_engines.json").read_text())["rows"][0]
    row = next(line for line in found[R.CLAIMS[2]].splitlines() if line.startswith(f"| {two['variant']} | {two['ms']:.1f} | "))
    assert row.endswith("| - | - |"), row  # no memory figures, and no error for their absence
    assert re.search(r"\| watchdog \| ZeRO-1 fp32 \| [0-9.]+ \(", found["Watchdog and rank-meeting cost"])


def test_a_cpu_without_bf16_kernels_leaves_bf16_out_and_says_so(tmp_path, monkeypatch):
    """On such a CPU a bf16 step times PyTorch's fallback matmul loop: the run is fp32 only, and the report
    says so at the top and gives the matmul times of the run in "Machines and files"."""
    import _bench as B
    monkeypatch.setattr(B, "bf16_kernels", lambda: False)
    monkeypatch.delenv("BENCH_BF16", raising=False)
    assert B.dtypes_here(["fp32", "bf16"]) == ["fp32"] and B.dtypes_here(["bf16"]) == []
    monkeypatch.setenv("BENCH_BF16", "1")
    assert B.dtypes_here(["fp32", "bf16"]) == ["fp32", "bf16"]
    took = {"meta": {"cpu": "AMD EPYC", "cpus": 2, "time": "2026-11-27 15:00:00"}, "total_s": 60,
            "bf16_kernels": False, "bf16_left_out": True, "matmul_ms": {"n": 512, "fp32": 3.4, "bf16": 215.9}, "benchmarks": {"overhead": 60}}
    (tmp_path / "bench_time.json").write_text(json.dumps(took))
    found = sections(R.Report(tmp_path, tmp_path).render())
    assert "CPU sections are fp32 only" in found["How to read this"]
    assert "512 x 512: 215.9 ms in bf16 against 3.4 ms in fp32" in found["Machines and files"]
    took["bf16_left_out"] = False  # BENCH_BF16=1 ran the bf16 rows on such a CPU
    (tmp_path / "bench_time.json").write_text(json.dumps(took))
    found = sections(R.Report(tmp_path, tmp_path).render())
    assert "fp32 only" not in found["How to read this"] and "bf16 matmul kernels" not in found["Machines and files"]


def test_every_plot_is_in_the_report(report):
    _, text = report
    for png in sorted(RESULTS.glob("*.png")):
        assert f"(results/{png.name})" in text, f"make bench draws {png.name}, but the report does not show it"


def _gap_line(results_dir):
    gaps = sections(R.Report(results_dir, results_dir).render())["Limits and open gaps"]
    return next((line for line in gaps.splitlines() if "FSDP2" in line), "")


def test_the_memory_gap_gives_each_runs_range_and_goes_where_ours_is_not_above(tmp_path):
    """The open-gap line on memory quotes the peak-RSS ratio with the range of its runs and FSDP2's own spread;
    a result from before the runs were kept renders without that sentence; where ours is at or below FSDP2's in
    every run, live and resident, there is no line."""
    data = json.loads((RESULTS / "memory_breakdown.json").read_text())
    ours = [r for r in data["rows"] if r["variant"] == "ours (Z2 + Z3)"]
    (tmp_path / "memory_breakdown.json").write_text(json.dumps(data))
    line = _gap_line(tmp_path)
    for r in ours:
        if max(r["rss_ratio_runs"]) > 1.0:
            assert f"{r['size']} {r['dtype']} {r['rss_ratio']:.2f} ({min(r['rss_ratio_runs']):.2f}-" in line, line
    for row in data["rows"]:
        for key in ("rss_ratio_runs", "rss_ratio", "peak_rss_runs_mb"):
            row.pop(key, None)
    (tmp_path / "memory_breakdown.json").write_text(json.dumps(data))
    assert "Peak RSS" not in _gap_line(tmp_path)
    for r in ours:
        r["live_ratio"], r["rss_ratio_runs"], r["rss_ratio"] = 1.0, [0.9, 1.0], 0.95
    (tmp_path / "memory_breakdown.json").write_text(json.dumps(data))
    assert _gap_line(tmp_path) == ""


def test_the_memory_gap_sets_the_per_block_memory_beside_its_step_time(tmp_path):
    """Where ours is above FSDP2's at default settings, the gap line gives the per-block setting's memory beside
    the same program's step time per block and at the default (both paired against FSDP2 in peers.json), and, where
    the per-block step adds no more than FSDP2's, what it holds more at the start; without peers.json's per-block
    row it gives no time of that program."""
    import shutil
    import statistics
    for name in ("overhead_block_floor.json", "peers.json"):
        shutil.copy(RESULTS / name, tmp_path / name)
    mem = json.loads((RESULTS / "memory_breakdown.json").read_text())
    size = "small"  # made the one furthest above FSDP2's, whatever the committed run measured
    for r in mem["rows"]:
        if r["variant"] == "ours (Z2 + Z3)":
            r["live_ratio"] = max(r["live_ratio"], 2.0) if r["size"] == size else min(r["live_ratio"], 1.0)
    (tmp_path / "memory_breakdown.json").write_text(json.dumps(mem))
    rows = {r["variant"]: r for r in json.loads((RESULTS / "peers.json").read_text())["rows"] if r["size"] == size}
    assert "ours, per block, no floor" in rows, "peers.py times the per-block setting"
    fsdp = rows["FSDP2"]["raw_ms"]
    line = _gap_line(tmp_path)
    for variant, said in (("ours, per block, no floor", "then steps"), ("ours (Z2 + Z3)", "against")):
        ratio = statistics.median(a / b for a, b in zip(rows[variant]["raw_ms"], fsdp))
        assert f"{said} {ratio:.3f} (" in line, (variant, line)
    per_block = next(r for r in mem["rows"] if r["variant"] == "ours, per block, no floor" and r["size"] == size
                     and r["dtype"] == "fp32")
    fsdp_mem = next(r for r in mem["rows"] if r["variant"] == "FSDP2" and r["size"] == size and r["dtype"] == "fp32")
    if per_block["step_growth_mb"] <= fsdp_mem["step_growth_mb"]:
        assert f"At {size} ours' per-block step adds less than FSDP2's ({per_block['step_growth_mb']:.1f}" in line, line
    (tmp_path / "peers.json").unlink()
    assert "the same program" not in _gap_line(tmp_path)


def test_the_files_table_lists_every_file_once_under_its_machine(report):
    """Files with the same machine line share a row with their dates' span; a CPU run's ``device`` (the processor,
    in fused_reduce.py's older results) is no GPU, and a GPU result's ``device`` names its card."""
    _, text = report
    body = sections(text)["Machines and files"]
    files = [p.relative_to(RESULTS) for p in sorted(RESULTS.rglob("*.json")) if "quick" not in p.parts]
    for rel in files:
        assert body.count(f"`{rel}`") == 1, rel
    assert R._gpu({"gpu": False, "device": "x86_64"}) is None
    assert R._gpu({"device": "NVIDIA H200"}) == "NVIDIA H200" and R._gpu({"gpu": "NVIDIA H100"}) == "NVIDIA H100"
    assert R._gpu({"device": "cpu"}) is None
