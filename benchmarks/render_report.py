"""Write benchmarks/PERFORMANCE.md from the benchmarks' JSON results, one section per claim.

    python benchmarks/render_report.py [--results benchmarks/results] [--out benchmarks/PERFORMANCE.md]
                                       [--readme README.md]

Run by ``make bench`` after the benchmarks (``benchmarks/run_all.sh``). Every figure in the report is
read or computed from a JSON file under ``--results`` (GPU cards: ``--results``/gpu/ and its
subfolders); nothing is typed by hand. A figure goes through :meth:`Report.fig`, which records it
for its section, so tests/unit/test_render_report.py can check that every number a section prints
came from a JSON. A result file that is missing renders as "not measured" with the command that
makes it. ``--readme`` rewrites the README's performance table (between the two markers) from the
same figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
README_BEGIN = "<!-- performance table: written by benchmarks/render_report.py -->"
README_END = "<!-- end of performance table -->"
# peers.py's variant names (not imported: peers.py imports torch, this renders without it)
OURS, PER_BLOCK = "ours (Z2 + Z3)", "ours, per block, no floor"
# A number as the report prints it; the test scans the report with the same pattern.
# Not a digit of a name: ZeRO-3, bf16, x86_64, Z2+Z3, trl#1730; but the upper end of a range (0.96-1.10) is one.
NUMBER = re.compile(r"(?<![\w.+/#])(?<![A-Za-z_]-)\d+(?:[.,]\d+)*")


def sections(text: str) -> dict:
    """Heading -> body of each '## ' section of a rendered report."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def numbers(text: str) -> list:
    """The numeric tokens of ``text`` outside code spans and link targets."""
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return NUMBER.findall(text)


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def paired(ours, base):
    """Per-step paired ratios ours[i] / base[i] (the two ran back to back in step i)."""
    return [a / b for a, b in zip(ours, base)]


def quartiles(xs):
    """(q1, median, q3) of ``xs``; q1 = q3 = median below four values."""
    med = statistics.median(xs)
    if len(xs) < 4:
        return med, med, med
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return q1, med, q3


class Report:
    def __init__(self, results: Path, out_dir: Path = HERE):
        self.results = results
        self.out_dir = out_dir
        self.lines = []
        self.figures = {}  # section title -> set of numeric tokens printed through fig()
        self.section = None
        self.summary = []  # (claim, compared, figure text, anchor) for the README table

    # ------------------------------------------------------------------ figures and files
    def fig(self, value, fmt: str = ".3f") -> str:
        """Format a value read from a JSON and record its numeric tokens for this section."""
        text = "unknown" if value is None else (value if isinstance(value, str) else format(value, fmt))
        self.figures.setdefault(self.section, set()).update(NUMBER.findall(text))
        return text

    def opt(self, value, fmt: str = ".3f") -> str:
        """A figure a run may not have measured (memory under ``--no-memory``): "-" when absent."""
        return "-" if value is None else self.fig(value, fmt)

    def ratio(self, ours, base) -> str:
        """Median of per-step paired ratios with its interquartile range, e.g. ``0.992 (0.95-1.03)``."""
        q1, med, q3 = quartiles(paired(ours, base))
        return f"{self.fig(med)} ({self.fig(q1, '.2f')}-{self.fig(q3, '.2f')})"

    @staticmethod
    def quotient(ours, base):
        """ours' peak memory / base's, or None where either was not measured."""
        a, b = ours.get("peak_mb"), base.get("peak_mb")
        return a / b if a is not None and b else None

    def load(self, rel: str):
        path = self.results / rel
        return json.loads(path.read_text()) if path.exists() else None

    def rel(self, rel: str) -> str:
        """``rel`` (under the results) as a path from the report's folder, for links."""
        return os.path.relpath(self.results / rel, self.out_dir)

    def result(self, rel: str):
        """The JSON at ``rel`` with its machine line written, or None with a "not measured" line."""
        data = self.load(rel)
        if data is None:
            self.missing(rel)
        else:
            self.out(self.machine(data, rel), "")
        return data

    def machine(self, data, rel: str) -> str:
        m = data.get("meta", {}) if data else {}
        where = _gpu(m) or "no GPU"
        cpu = m.get("cpu") or "CPU model unknown"
        cores = self.fig(m.get("cpus"), "d") + " cores" if m.get("cpus") else "cores unknown"
        ds = self.fig(m.get("deepspeed")) if m.get("deepspeed") else "unknown"
        return (f"_Run: `{rel}`: {self.fig(cpu)}, {cores}, {self.fig(where)}, torch {self.fig(m.get('torch'))}, DeepSpeed {ds}, "
                f"{self.fig(m.get('time')) if m.get('time') else 'date unknown'}._")

    # ------------------------------------------------------------------ layout
    def out(self, *lines):
        self.lines.extend(lines)

    def start(self, title: str, compared: str, baseline: str, command: str):
        self.section = title
        self.out(f"## {title}", "", f"**Compared:** {compared}  ", f"**Baseline:** {baseline}  ",
                 f"**Rerun:** `{command}`", "")

    def plot(self, rel: str):
        if (self.results / rel).exists():
            self.out(f"![{Path(rel).stem}]({self.rel(rel)})", "")

    def missing(self, rel: str):
        self.out(f"Not measured: `{self.rel(rel)}` is not in these results.", "")

    def table(self, headers, rows):
        self.out("| " + " | ".join(headers) + " |", "|" + "---|" * len(headers))
        self.out(*("| " + " | ".join(str(c) for c in row) + " |" for row in rows))
        self.out("")

    def headline(self, claim: str, compared: str, figure: str):
        self.summary.append((claim, compared, figure, anchor(self.section)))

    # ------------------------------------------------------------------ claims
    def overhead(self):
        self.start("Single-engine overhead against upstream",
                   "one engine, one model (`overhead.py`): `deepspeed_multi.initialize` + `loss.backward()`",
                   "upstream `deepspeed.initialize` + `engine.backward(loss)`, same ranks, steps interleaved",
                   "python benchmarks/overhead.py --dtypes fp32 bf16 --steps 100")
        for rel, card in (("overhead.json", "CPU"), ("gpu/overhead.json", "GPU")):
            data = self.result(rel)
            if data is None:
                continue
            rows = []
            memory = all("mem_ratio" in r for r in data["rows"])  # each variant alone in fresh processes
            for r in data["rows"]:
                rows.append([f"ZeRO-{r['stage']}", r["dtype"], self.fig(r["upstream_ms"], ".1f"),
                             self.fig(r["ours_ms"], ".1f"), self.ratio(r["raw_ms"]["ours"], r["raw_ms"]["upstream"])]
                            + ([self.fig(r["upstream_mem_mb"], ".1f"), self.fig(r["ours_mem_mb"], ".1f"),
                                self.fig(r["mem_ratio"])] if memory else []))
            self.table(["stage", "dtype", "upstream ms", "ours ms", "ours / upstream (IQR)"]
                       + ([f"upstream peak {'RSS' if card == 'CPU' else 'allocated'} MiB", "ours peak MiB",
                           "ours / upstream, memory"] if memory else []), rows)
            if card == "GPU":
                self.headline(f"one engine on one {self.fig(data['meta']['gpu'])}, one rank, fp32 / bf16",
                              "upstream `engine.backward(loss)`",
                              " / ".join(self.fig(r["ratio"]) for r in data["rows"] if r["dtype"] == "fp32") + ", " +
                              " / ".join(self.fig(r["ratio"]) for r in data["rows"] if r["dtype"] == "bf16"))
            if card == "CPU":
                self.headline("one engine, `loss.backward()`, ZeRO-1/2/3 fp32",
                              "upstream `engine.backward(loss)`",
                              " / ".join(self.fig(r["ratio"]) for r in data["rows"] if r["dtype"] == "fp32"))
        self.plot("overhead.png")
        self.features()
        self.out("ZeRO-3's update reads the gradient buffer as a view instead of DeepSpeed's flattened copy "
                 "(`zero3_grad_view.py`, the peers LLM alone):", "")
        view = self.result("zero3_grad_view.json")
        if view is None:
            return
        res = view["results"]
        rows = [[name, self.fig(v["step_ms"], ".1f"), self.fig(v["total_ms"], ".1f"),
                 self.fig(v.get("view_over_this_step", 1.0)), self.fig(v.get("view_over_this_total", 1.0)),
                 self.fig(v["peak_mb"], ".1f")] for name, v in res.items()]
        self.table(["variant", "`step()` ms", "iteration ms", "view / this (step)", "view / this (iteration)",
                    "peak MiB"], rows)
        self.out(f"Weights bit-identical between view and copy: {view.get('bit_identical')}.", "")
        self.headline("ZeRO-3 update: the gradient buffer as a view", "DeepSpeed's flattened copy",
                      f"`step()` {self.fig(res['copy']['view_over_this_step'])}")

    def features(self):
        self.out("The single-engine features on against off in the same ranks (`overhead.py --<feature>`; machine "
                 f"lines: [Machines and files](#{anchor('Machines and files')})), paired per step:", "")
        rows = []
        for feature, off in (("overflow_by_norm", "ours_off"), ("bucket_size", "ours_off"),
                             ("lazy_grads", "ours_off"), ("cast_on_gather", "ours_off"), ("block_sizes", "ours_off"),
                             ("block_floor", "ours_off"), ("rank_order", "ours_off")):
            data = self.load(f"overhead_{feature}.json")
            if data is None:
                continue
            for r in data["rows"]:
                raw = r["raw_ms"]
                off = "ours_off" if "ours_off" in raw else "ours_watchdog_off"  # the watchdog's older name for it
                rows.append([feature.replace("_", "-"), f"ZeRO-{r['stage']} {r['dtype']}", self.ratio(raw["ours"], raw[off]),
                             self.ratio(raw["ours"], raw["upstream"]), self.fig(r["ours_ms"], ".1f")])
        if rows:
            self.table(["feature", "config", "on / off (IQR)", "on / upstream (IQR)", "ours ms"], rows)

    def fused_path(self):
        self.start("Many small parameters: the fused path",
                   "a model of many small `Linear` layers, gradient accumulation, three engines interleaved: "
                   "ours with the fused bucket passes on, ours with them off, upstream",
                   "upstream `engine.backward(loss)`, and ours with `fused_reduce: false`",
                   "python benchmarks/fused_reduce_e2e.py --steps 20")
        data = self.result("fused_reduce_e2e.json")
        if data is None:
            return
        m = data["meta"]
        self.out(f"Model: {self.fig(m['layers'], 'd')} x `Linear` of width {self.fig(m['dim'], 'd')}, "
                 f"gas {self.fig(m['gas'], 'd')}, {self.fig(m['world'], 'd')} ranks, median of "
                 f"{self.fig(m['steps'], 'd')} steps.", "")
        rows = []
        for r in data["rows"]:
            raw = r.get("raw_ms")
            rows.append([f"ZeRO-{r['stage']}", self.fig(r["upstream_ms"], ".2f"), self.fig(r["off_ms"], ".2f"),
                         self.fig(r["on_ms"], ".2f"),
                         self.ratio(raw["off"], raw["on"]) if raw else self.fig(r["off_over_on"]) + " (IQR unknown)",
                         self.ratio(raw["upstream"], raw["on"]) if raw else self.fig(r["upstream_over_on"]) + " (IQR unknown)",
                         self.fig(r["max_abs_diff"], ".1e")])
        self.table(["stage", "upstream ms", "off ms", "on ms", "off / on", "upstream / on", "max abs(w_on - w_off)"], rows)
        z2 = next((r for r in data["rows"] if r["stage"] == 2), None)
        if z2:
            self.headline("many small parameters, ZeRO-2, fused bucket passes", "upstream `engine.backward(loss)`",
                          f"{self.fig(z2['upstream_over_on'])}x faster")

    def growth(self):
        self.start("Engines in one loss: against the super-module and DeepSpeed's own engines",
                   "N engines under one `loss.backward()` (`two_engines.py`: encoder ZeRO-2 -> LLM ZeRO-3; "
                   "`growth.py`: N one-block towers, chained or side by side, stages alternating, all ZeRO-2 "
                   "or all ZeRO-3; and an encoder -> LLM pair as its parameter count grows)",
                   "the same modules in one upstream ZeRO-3 engine (the super-module); `growth.py --upstream` "
                   "adds DeepSpeed's own N engines",
                   "python benchmarks/growth.py --upstream && python benchmarks/two_engines.py")
        two = self.result("two_engines.json")
        if two is not None:
            rows, base = [], {r["variant"]: r for r in two["rows"]}
            for r in two["rows"]:
                sup = base.get("super-module (frozen LLM)" if "frozen" in r["variant"] else "super-module")
                rows.append([r["variant"], self.fig(r["ms"], ".1f"), self.ratio(r["raw_ms"], sup["raw_ms"]),
                             self.opt(r.get("peak_mb"), ".1f"), self.opt(r.get("mem_vs_supermodule"))])
            self.table(["variant", "ms", "time / super-module (IQR)", "peak MiB", "memory / super-module"], rows)
            self.plot("two_engines.png")
            r = base["two engines"]
            self.headline("encoder (ZeRO-2) -> LLM (ZeRO-3), two engines", "super-module in one ZeRO-3 engine",
                          f"time {self.fig(r['time_vs_supermodule'])}, memory {self.opt(r.get('mem_vs_supermodule'))}")
        data = self.result("growth.json")
        if data is None:
            return
        ns = sorted({r["n"] for r in data["engines"]})
        has_up = any("upstream" in r for r in data["engines"])
        rows = []
        for stages in dict.fromkeys(r["stages"] for r in data["engines"]):
            for wiring in dict.fromkeys(r["wiring"] for r in data["engines"]):
                cells = {r["n"]: r for r in data["engines"] if r["stages"] == stages and r["wiring"] == wiring}
                row = [self.fig(stages), wiring]
                for n in ns:
                    r = cells.get(n)
                    row.append(self.ratio(r["ours"], r["super-module"]) if r else "-")
                rows.append(row)
                if has_up:
                    rows.append([self.fig(stages), wiring + ", / DeepSpeed's N engines"] + [
                        self.ratio(cells[n]["ours"], cells[n]["upstream"]) if n in cells and "upstream" in cells[n]
                        else "-" for n in ns])
        self.out("Ours / super-module (paired median, IQR) by number of engines N; stages `alt` alternates ZeRO-2 and "
                 "ZeRO-3 engines, `2` and `3` put every engine at that stage:", "")
        self.table(["stages", "wiring"] + [f"N = {self.fig(n, 'd')}" for n in ns], rows)
        if not has_up:
            self.out("DeepSpeed's own N engines under one loss are not in these results "
                     "(`growth.py --upstream` adds them); their collectives are counted in "
                     f"[What one step issues](#{anchor('What one step issues')}).", "")
        rows = [[self.fig(r["params"], ",d"), self.fig(r["ours_ms"], ".1f"), self.fig(r["super_ms"], ".1f"),
                 self.ratio(r["ours"], r["super-module"])] for r in data.get("params", [])]
        if rows:
            self.out("Encoder (ZeRO-2) -> LLM (ZeRO-3) by parameter count:", "")
            self.table(["parameters", "ours ms", "super-module ms", "ours / super-module (IQR)"], rows)
        self.plot("growth.png")

    def peers(self):
        self.start("Encoder to LLM against FSDP2: time and memory by buffer",
                   "encoder ZeRO-2 -> LLM ZeRO-3, both trained, one loss, AdamW, two sizes (`peers.py`); "
                   "memory by buffer (`memory_breakdown.py`: what each holder keeps after the backward, "
                   "the peak of live tensors in a step and its phase)",
                   "PyTorch FSDP2 (`fully_shard` per block) and the super-module (one upstream ZeRO-3 engine)",
                   "python benchmarks/peers.py && python benchmarks/memory_breakdown.py --repeat 5 --at-peak")
        data = self.result("peers.json")
        if data is not None:
            rows = []
            for size in dict.fromkeys(r["size"] for r in data["rows"]):
                group = [r for r in data["rows"] if r["size"] == size]
                ours = next(r for r in group if r["variant"] == OURS)
                for r in group:
                    rows.append([size, self.fig(r["params"], ",d"), r["variant"], self.fig(r["ms"], ".1f"),
                                 "-" if r is ours else self.ratio(ours["raw_ms"], r["raw_ms"]),
                                 self.opt(r.get("peak_mb"), ".1f"), "-" if r is ours else self.opt(r.get("ours_mem_ratio"))])
                fsdp = next(r for r in group if r["variant"] == "FSDP2")
                self.headline(f"encoder -> LLM, {size} ({self.fig(ours['params'], ',d')} parameters)",
                              "PyTorch FSDP2", f"time {self.fig(fsdp['ours_time_ratio'])}, "
                              f"peak RSS {self.opt(fsdp.get('ours_mem_ratio'))}")
            self.table(["size", "parameters", "variant", "ms", "ours / this, time (IQR)", "peak RSS MiB",
                        "ours / this, memory"], rows)
            self.plot("peers.png")
        mem = self.result("memory_breakdown.json")
        if mem is not None:
            self.out("MiB per rank after the last backward, by holder; peak of live tensors over a step / FSDP2's "
                     "(median over repeats, with their range):", "")
            self.memory_table(mem, "peak_live_mb")
            self.rss_table(mem)
            ours = [r for r in mem["rows"] if r["variant"] == OURS]
            self.headline("peak live tensors, encoder -> LLM, default settings", "PyTorch FSDP2",
                          ", ".join(f"{r['size']} {r['dtype']} {self.fig(r['live_ratio'], '.2f')}" for r in ours))
            self.plot("memory_breakdown.png")
        for card in self.cards():
            gpu = self.load(f"{card}/memory_breakdown_bucket.json")
            if gpu is None:
                continue
            self.out(f"On one GPU, one rank (nothing sharded across ranks: a check of the method), the allocator's "
                     "peak over a step:", "", self.machine(gpu, f"{card}/memory_breakdown_bucket.json"), "")
            self.memory_table(gpu, "cuda_step_peak_mb")

    def memory_table(self, data, peak_key):
        buckets = ["parameters", "fp32 master", "gradients", "buckets", "optimizer states"]
        rows = []
        for r in data["rows"]:
            fsdp = _beside(data, "FSDP2", r)
            by = r["by_buffer_mb"]
            ratio = "-"
            if fsdp is not None and r is not fsdp:
                ratio = (self.ratio_runs(r, "live") if peak_key == "peak_live_mb" and r.get("live_ratio_runs")
                         else self.fig(r[peak_key] / fsdp[peak_key], ".2f"))
            rows.append([r["size"], r["dtype"], r["variant"]] + [self.fig(by.get(b, 0.0), ".1f") for b in buckets] + [
                self.fig(r["activations_mb"], ".1f"), self.fig(r[peak_key], ".1f"), r["peak_phase"], ratio])
        self.table(["size", "dtype", "variant"] + buckets + ["activations", "peak", "peak phase", "peak / FSDP2"], rows)

    def rss_table(self, data):
        """memory_breakdown's resident set by phase (CPU runs; absent from older results)."""
        rows = [r for r in data["rows"] if r.get("rss_phases_mb")]
        if not rows:
            return
        steps = [k for k in rows[0]["rss_phases_mb"] if k.startswith("after step")]
        self.out("Resident memory by phase, MiB above the resident set before the build (median over repeats): the "
                 "build's high-water mark (the user's model, its copy and the engines' construction copies), what "
                 "stays resident after the build and after each step, and the live tensors at the start of the "
                 "profiled step. Resident minus live is mostly free memory the C allocator (glibc) keeps in its heap "
                 "to reuse for the next allocations (the super-module is left out: its bucket at DeepSpeed's default size "
                 "is allocated but never touched, so never resident):", "")
        self.table(["size", "dtype", "variant", "build peak", "after build", *map(self.fig, steps), "peak RSS",
                    "peak RSS / FSDP2 (runs)", "live tensors", "resident - live"],
                   [[r["size"], r["dtype"], r["variant"]]
                    + [self.fig(r["rss_phases_mb"][k], ".1f") for k in ("build peak", "after build", *steps)]
                    + [self.fig(r["peak_rss_mb"], ".1f"), self.ratio_runs(r, "rss"),
                       self.fig(r["rss_phases_mb"]["live tensors"], ".1f"),
                       self.fig(r["rss_phases_mb"][steps[-1]] - r["rss_phases_mb"]["live tensors"], ".1f")]
                    for r in rows if not r["variant"].startswith("super")])

    def memory_gap(self, mem):
        """The open-gap bullet on memory at default settings: where the peak of live tensors and peak RSS are above
        FSDP2's ("" where neither is)."""
        ours = [r for r in mem["rows"] if r["variant"] == OURS]
        above = [r for r in ours if r["live_ratio"] > 1.0]
        said = []
        if above:
            said.append("At default settings the peak of live tensors is above FSDP2's: " + ", ".join(
                f"{r['size']} {r['dtype']} {self.fig(r['live_ratio'], '.2f')}x" for r in above) + ".")
            worst = max(above, key=lambda r: r["live_ratio"])
            per_block = _beside(mem, PER_BLOCK, worst)
            floor = self.load("overhead_block_floor.json")
            z3 = next((r for r in floor["rows"] if r["stage"] == 3 and r["dtype"] == "fp32"), None) if floor else None
            if per_block and z3:
                m = floor["meta"]
                said.append(f"Per block (`min_block_elements: 0`, FSDP2's granularity) the {worst['size']} one is "
                            f"{self.fig(per_block['live_ratio'], '.2f')}x{self.per_block_time(worst['size'])}, and a "
                            "single ZeRO-3 engine per block over "
                            f"{self.fig(m['layers'], 'd')} blocks of width {self.fig(m['dim'], 'd')} steps "
                            f"{self.ratio(z3['raw_ms']['ours_off'], z3['raw_ms']['upstream'])} of upstream against "
                            f"{self.ratio(z3['raw_ms']['ours'], z3['raw_ms']['upstream'])} at the default (the "
                            "`block-floor` row above): blocks under `min_block_elements` are grouped for the step time.")
            for r in above:  # the default, else its per-block row: the first whose step adds no more than FSDP2's
                fsdp = _beside(mem, "FSDP2", r)
                for how, row, sharded in (("ours'", r, _beside(mem, "ours (Z3 + Z3)", r)),
                                          ("ours' per-block", _beside(mem, PER_BLOCK, r),
                                           _beside(mem, "ours (Z3 + Z3), per block", r))):
                    if fsdp and row and sharded and row.get("step_growth_mb", 1e9) <= fsdp.get("step_growth_mb", 0):
                        said.append(f"At {r['size']} {how} step adds less than FSDP2's "
                                    f"({self.fig(row['step_growth_mb'], '.1f')} against "
                                    f"{self.fig(fsdp['step_growth_mb'], '.1f')} MiB) on more held at its start "
                                    f"({self.fig(row['live_at_step_start_mb'], '.1f')} against "
                                    f"{self.fig(fsdp['live_at_step_start_mb'], '.1f')}): the ZeRO-2 encoder's whole "
                                    f"parameters, which FSDP2 shards (with the encoder at ZeRO-3 too, "
                                    f"{self.fig(sharded['live_ratio'], '.2f')}x).")
                        break
        said.append(self.rss_gap(mem, ours))
        return " ".join(filter(None, said))

    def per_block_time(self, size):
        """" while the same program then steps X of FSDP2's time against Y at the default (`peers.py`)": peers.json's
        paired ratios at ``size`` per block and at the default; "" where it has no per-block row there."""
        rows = {r["variant"]: r for r in (self.load("peers.json") or {"rows": []})["rows"] if r["size"] == size}
        per_block, ours, fsdp = (rows.get(v) for v in (PER_BLOCK, OURS, "FSDP2"))
        if not (per_block and ours and fsdp):
            return ""
        return (f" while the same program then steps {self.ratio(per_block['raw_ms'], fsdp['raw_ms'])} of FSDP2's time "
                f"against {self.ratio(ours['raw_ms'], fsdp['raw_ms'])} at the default (`peers.py`)")

    def rss_gap(self, mem, ours):
        """The sentence on peak RSS at default settings where it is above FSDP2's in some run ("" otherwise, for
        results from before each run's RSS was kept, and on a GPU, where that field is the allocator's peak)."""
        rows = [r for r in ours if r.get("rss_ratio_runs") and r.get("device") == "cpu"]
        if not rows or max(max(r["rss_ratio_runs"]) for r in rows) <= 1.0:
            return ""
        fsdp = {(f["size"], f["dtype"]): f["peak_rss_runs_mb"] for f in mem["rows"]
                if f["variant"] == "FSDP2" and f.get("peak_rss_runs_mb")}
        said = [f"{r['size']} {r['dtype']} {self.ratio_runs(r, 'rss')}" for r in rows]
        spread = [f"{self.fig(min(v), '.1f')} to {self.fig(max(v), '.1f')} MiB ({size})"
                  for (size, _), v in fsdp.items() if len(v) > 1]
        design = os.path.relpath(ROOT / "docs" / "design.md", self.out_dir)
        return (f"Peak RSS at default settings, ours / FSDP2's, median of {self.fig(len(rows[0]['rss_ratio_runs']), 'd')} "
                f"runs (their range): {', '.join(said)}" + (f"; FSDP2's own moved from {', '.join(spread)} across "
                                                               "those runs" if spread else "")
                + f". Resident memory on CPU is mostly the C allocator's heap ([docs/design.md]({design}#decisions)).")

    def ratio_runs(self, row, key):
        """``row``'s median ``key`` ratio to FSDP2's with its runs' range; "-" for FSDP2 itself or a result
        from before the runs were kept."""
        runs = row.get(f"{key}_ratio_runs")
        if not runs or row["variant"] == "FSDP2":
            return "-"
        return self.fig(row[f"{key}_ratio"], ".2f") + (f" ({self.fig(min(runs), '.2f')}-{self.fig(max(runs), '.2f')})"
                                                       if len(runs) > 1 else "")

    def parts(self):
        self.start("One model in parts: against whole-model ZeRO-3 and FSDP2",
                   "vision tower -> projector -> LLM as one module under one loss, the LLM at ZeRO-3 and the "
                   "rest at ZeRO-2 (`deepspeed_multi.submodules`), two sizes (`parts.py`); and "
                   "the peak memory while building the model",
                   "the whole model in one upstream ZeRO-3 engine; PyTorch FSDP2 sharding only the LLM; for "
                   "building, plain construction and `deepspeed.zero.Init` for the whole model",
                   "python benchmarks/parts.py")
        data = self.result("parts.json")
        if data is None:
            return
        rows = []
        for r in data["rows"]:
            ours = next(o for o in data["rows"] if o["size"] == r["size"] and o["dtype"] == r["dtype"]
                        and o["variant"].startswith("ours"))
            rows.append([r["size"], self.fig(r["params"], ",d"), r["dtype"], r["variant"], self.fig(r["ms"], ".1f"),
                         "-" if r is ours else self.ratio(ours["raw_ms"], r["raw_ms"]), self.opt(r.get("peak_mb"), ".1f"),
                         "-" if r is ours else self.opt(r.get("ours_mem_ratio"))])
        self.table(["size", "parameters", "dtype", "variant", "ms", "ours / this, time (IQR)", "peak MiB",
                    "ours / this, memory"], rows)
        whole = [r for r in data["rows"] if r["variant"].startswith("whole")]
        self.headline("one model in parts (LLM ZeRO-3, the rest ZeRO-2), time", "whole model in one ZeRO-3 engine",
                      "; ".join(f"{r['size']} {r['dtype']} {self.fig(r['ours_time_ratio'])}" for r in whole))
        rows = [[c["size"], c["dtype"], c["build"], self.fig(c["peak_mb"], ".1f"),
                 self.fig(c["llm_params_on_rank"], ",d"), self.fig(c["llm_params"], ",d")]
                for c in data.get("construction", [])]
        if rows:
            self.out("Building the model:", "")
            self.table(["size", "dtype", "build", "peak MiB per rank", "LLM parameters on a rank", "LLM parameters"],
                       rows)
        self.plot("parts.png")

    def distillation(self):
        self.start("Distillation", "a trained student and a frozen teacher (teacher forward under "
                   "`torch.no_grad()`), ours with the student at ZeRO-2 and the teacher at ZeRO-3, and both at ZeRO-3",
                   "the same layouts as upstream engines, and both models at ZeRO-3",
                   "python benchmarks/distillation.py")
        data = self.result("distillation.json")
        if data is None:
            return
        by = {r["variant"]: r for r in data["rows"]}
        rows = []
        for r in data["rows"]:
            cells = [r["variant"], self.fig(r["ms"], ".1f"), self.opt(r.get("peak_mb"), ".1f")]
            up = by.get(r["variant"].replace("ours", "upstream"))
            cells.append(self.ratio(r["raw_ms"], up["raw_ms"]) if r["variant"].startswith("ours") and up else "-")
            z3 = by.get("ours Z3+Z3")
            cells.append(self.ratio(r["raw_ms"], z3["raw_ms"]) + ", memory " + self.opt(self.quotient(r, z3))
                         if r["variant"] == "ours Z2+Z3" and z3 else "-")
            rows.append(cells)
        self.table(["variant", "ms", "peak MiB", "ours / upstream, same layout (IQR)", "Z2+Z3 / Z3+Z3 (IQR)"], rows)
        self.plot("distillation.png")
        o, z3 = by.get("ours Z2+Z3"), by.get("ours Z3+Z3")
        if o and z3:
            self.headline("distillation: ZeRO-2 student + frozen ZeRO-3 teacher", "both at ZeRO-3",
                          f"time {self.fig(quartiles(paired(o['raw_ms'], z3['raw_ms']))[1])}, "
                          f"memory {self.opt(self.quotient(o, z3))}")

    def rlhf(self):
        self.start("RLHF step", "actor (ZeRO-2) and critic (ZeRO-3) trained, reference and reward (ZeRO-3) frozen, the "
                   "actor's output through the reward model with grad; ours: one `loss.backward()`",
                   "upstream: `actor.backward` + `critic.backward` (the reward model called unwrapped: upstream "
                   "refuses a gradient through a frozen engine)", "python benchmarks/rlhf_step.py")
        data = self.result("rlhf_step.json")
        if data is None:
            return
        raw = data["raw_ms"]
        rows = [[phase, self.fig(data["median_ms"]["upstream"][phase], ".1f"),
                 self.fig(data["median_ms"]["ours"][phase], ".1f"), self.ratio(raw["ours"][phase], raw["upstream"][phase])]
                for phase in data["median_ms"]["ours"]]
        peak = data.get("peak_mb") or {}
        rows.append(["peak MiB", self.opt(peak.get("upstream"), ".1f"), self.opt(peak.get("ours"), ".1f"),
                     self.opt(self.quotient({"peak_mb": peak.get("ours")}, {"peak_mb": peak.get("upstream")}))])
        self.table(["phase", "upstream ms", "ours ms", "ours / upstream (IQR)"], rows)
        self.plot("rlhf_step.png")
        self.headline("RLHF step, four engines, one `loss.backward()`", "upstream, one `engine.backward` per trained engine",
                      self.fig(quartiles(paired(raw["ours"]["total"], raw["upstream"]["total"]))[1]))

    def dpo(self):
        self.start("TRL DPO: the reference at its own stage",
                   "one `trl.DPOTrainer` step on a Llama built from a config, `multi_engine_trainer(DPOTrainer)` with "
                   "the policy at ZeRO-2 and the reference at ZeRO-3 (`deepspeed_roles`); each variant in fresh "
                   "processes, not interleaved",
                   "the policy at ZeRO-3 too; plain TRL (its reference at stage 0, a full replica per rank); our "
                   "trainer without roles", "python benchmarks/dpo_roles.py")
        data = self.result("dpo_roles.json")
        if data is None:
            return
        m = data["meta"].get("model", {})
        self.out(f"Model: hidden {self.fig(m.get('hidden'), 'd')}, {self.fig(m.get('layers'), 'd')} layers, vocabulary "
                 f"{self.fig(m.get('vocab'), 'd')}, {self.fig(data['meta'].get('dtype'))}.", "")
        rows = []
        for r in data["rows"]:
            q1, _, q3 = quartiles(r["raw_ms"])
            rows.append([r["variant"], self.fig(r["stages"]["policy"], "d"), self.fig(r["stages"]["reference"], "d"),
                         f"{self.fig(r['ms'], '.0f')} ({self.fig(q1, '.0f')}-{self.fig(q3, '.0f')})",
                         self.fig(r["peak_mb"], ".1f"), self.fig(r["time_ours_over_this"]),
                         self.fig(r["mem_ours_over_this"])])
        self.table(["variant", "policy stage", "reference stage", "ms (IQR)", "peak MiB", "ours / this, time",
                    "ours / this, memory"], rows)
        self.plot("dpo_roles.png")
        z3 = next((r for r in data["rows"] if r["stages"]["policy"] == 3), None)
        if z3:
            self.headline("TRL DPO, policy ZeRO-2 + reference ZeRO-3", "both at ZeRO-3",
                          f"time {self.fig(z3['time_ours_over_this'])}, memory {self.fig(z3['mem_ours_over_this'])}")

    def generation(self):
        self.start("Generation from a ZeRO-3 engine",
                   "greedy `generate()` from a frozen ZeRO-3 engine (`generation.py`): ours in its generation mode "
                   "(the default: the whole model gathered once, no per-module hooks) and module by module "
                   "(`generation_gather_bytes: 0`, synced)",
                   "the same model unsharded on every rank; upstream's ZeRO-3 `module.generate(synced_gpus=True)`, "
                   "bare and inside `GatheredParameters`", "python benchmarks/generation.py")
        data = self.result("generation.json")
        if data is None:
            return
        m = data["meta"]
        self.out(f"Model: a Llama of {self.fig(m.get('params', 0) / 1e6, '.2f')}M parameters ({self.fig(m.get('layers'), 'd')} "
                 f"layers, width {self.fig(m.get('width'), 'd')}), batch {self.fig(m.get('batch'), 'd')}, "
                 f"{self.fig(m.get('new_tokens'), 'd')} new tokens; every variant's tokens equal the unsharded model's.", "")
        by = {r["variant"]: r for r in data["rows"]}
        base = by["unsharded"]
        rows = [[r["variant"], self.fig(r["ms"], ".0f"), self.fig(r["tokens_per_s"], ".0f"),
                 self.ratio(r["raw_ms"], base["raw_ms"]), self.opt(r.get("peak_mb"), ".1f"),
                 self.opt(self.quotient(r, base), ".2f")] for r in data["rows"]]
        self.table(["variant", "ms per generate", "tokens/s per rank", "time / unsharded (IQR)", "peak MiB",
                    "memory / unsharded"], rows)
        mode = by.get("ours, generation mode")
        if mode:
            self.headline("ZeRO-3 generation, generation mode", "the model unsharded",
                          f"time {self.fig(quartiles(paired(mode['raw_ms'], base['raw_ms']))[1])} "
                          f"(upstream {self.fig(quartiles(paired(by['upstream']['raw_ms'], base['raw_ms']))[1])})")

    def counts(self):
        self.start("What one step issues", "one step of `growth.py`'s towers and of the RLHF step, counted (not timed; "
                   "max over ranks; after eight warm-up steps): collectives, operators dispatched, host syncs, store "
                   "meetings (our ranks' rendezvous before an engine's collectives, gloo only, held where the loop's "
                   "recent regions do not predict the region) and what the step allocates",
                   "upstream (N `deepspeed.initialize` engines, one `loss.backward()`) and the super-module",
                   "python benchmarks/counts.py")
        data = self.result("counts.json")
        if data is None:
            return
        rows = []
        for r in data["rows"]:
            if r["workload"] != "rlhf step" and (r["workload"] != "towers chained" or r["n"] not in (1, 8, 16)):
                continue
            rows.append([r["workload"], self.fig(r["stages"]), self.fig(r["n"], "d"), r["variant"], self.fig(r["collectives"], "d"),
                         self.fig(r["collective_mb"], ".1f"), self.fig(r["ops"], ",d"), self.fig(r["host_syncs"], "d"),
                         self.fig(r["store_meetings"], "d"), self.fig(r["allocated_mb"], ",.1f")])
        self.table(["workload", "stages", "N", "variant", "collectives", "collective MiB", "operators", "host syncs",
                    "store meetings", "allocated MiB"], rows)
        self.out("Every N, and the towers side by side: `results/counts.json`.", "")
        self.plot("counts.png")
        alt8 = {r["variant"]: r for r in data["rows"] if r["workload"] == "towers chained" and r["stages"] == "alt"
                and r["n"] == 8}
        if {"ours", "upstream"} <= set(alt8):
            self.headline("what a step allocates, eight engines, DeepSpeed's default buckets", "upstream engines",
                          f"{self.fig(alt8['ours']['allocated_mb'], ',.1f')} vs "
                          f"{self.fig(alt8['upstream']['allocated_mb'], ',.1f')} MiB")

    def cards(self):
        """Result folders of GPU cards: gpu/ itself and each of its subfolders with JSON files."""
        gpu = self.results / "gpu"
        if not gpu.is_dir():
            return []
        found = [p for p in [gpu] + sorted(gpu.iterdir()) if p.is_dir() and any(p.glob("*.json"))]
        return [str(p.relative_to(self.results)) for p in found]

    def fused_ops(self):
        self.start("Fused ops: CPU and GPU cards",
                   "the fused gradient-bucket round trip (pack + scale + overflow flag, then unpack-accumulate into "
                   "fp32 partitions) and ZeRO-3's reduce-scatter input (`pack_partitions`), op alone",
                   "the unfused torch sequence ZeRO-2/3 run per tensor, a plain `copy_` of the same bytes, "
                   "DeepSpeed's slice + cat + divide", "python benchmarks/fused_reduce.py [--device cuda]")
        files = [("fused_reduce.json", "CPU")] + [
            (f"{card}/{f.name}", card) for card in self.cards()
            for f in sorted((self.results / card).glob("fused_reduce*.json"))]
        for rel, _card in files:
            data = self.result(rel)
            if data is None:
                continue
            gpu = any("device_ms" in r for r in data["rows"])
            self.out(f"Buckets of {self.fig(data['meta']['dtype'])}:", "")
            rows = []
            for (n, mb) in dict.fromkeys((r["tensors"], r["bucket_mb"]) for r in data["rows"]):
                by = {r["method"]: r for r in data["rows"] if (r["tensors"], r["bucket_mb"]) == (n, mb)}
                f = by["fused"]
                row = [self.fig(n, ",d"), self.fig(mb, ".0f"), self.fig(by["copy"]["ms"], ".3f"), self.fig(f["ms"], ".3f"),
                       self.fig(by["unfused"]["ms"], ".3f"), self.fig(f["speedup_vs_unfused"], ".1f")]
                row.append(self.fig(f["device_fraction_of_copy"], ".2f") if gpu else self.fig(f["fraction_of_copy"], ".2f"))
                rows.append(row)
            self.table(["tensors", "bucket MB", "copy ms", "fused ms", "unfused ms", "fused vs unfused (x)",
                        "copy / fused (GPU time)" if gpu else "copy / fused"], rows)
            scatter = ", ".join(f"{self.fig(s['tensors'], ',d')} tensors / {self.fig(s['bucket_mb'], '.0f')} MB: "
                                f"{self.fig(s['speedup'], '.1f')}x" for s in data.get("scatter_input", []))
            if scatter:
                self.out(f"Reduce-scatter input against DeepSpeed's: {scatter}.", "")
            cached = [(n, mb) for (n, mb) in dict.fromkeys((r["tensors"], r["bucket_mb"]) for r in data["rows"])
                      if any(r["method"] == "fused-nocache" and (r["tensors"], r["bucket_mb"]) == (n, mb)
                             for r in data["rows"])]
            if cached:
                n, mb = max(cached, key=lambda k: (k[0], -k[1]))  # most tensors in the fewest bytes: host-bound
                by = {r["method"]: r for r in data["rows"] if (r["tensors"], r["bucket_mb"]) == (n, mb)}
                self.out(f"The device table kept from the last call with the same tensors, {self.fig(n, ',d')} tensors / "
                         f"{self.fig(mb, '.0f')} MB: fused {self.fig(by['fused']['ms'], '.3f')} ms "
                         f"(GPU {self.fig(by['fused']['device_ms'], '.3f')} ms), the same op with the table built and "
                         f"copied at every call {self.fig(by['fused-nocache']['ms'], '.3f')} ms "
                         f"(GPU {self.fig(by['fused-nocache']['device_ms'], '.3f')} ms).", "")
            if gpu and data["meta"]["dtype"] == "bf16":
                big = max((r for r in data["rows"] if r["method"] == "fused"), key=lambda r: (r["bucket_mb"], r["tensors"]))
                self.headline(f"fused bucket pass, {self.fig(big['tensors'], ',d')} tensors / "
                              f"{self.fig(big['bucket_mb'], '.0f')} MB bf16, {self.fig(data['meta']['device'])}",
                              "the unfused torch sequence; a `copy_` of the same bytes (GPU time)",
                              f"{self.fig(big['speedup_vs_unfused'], '.1f')}x faster; copy / fused "
                              f"{self.fig(big['device_fraction_of_copy'], '.2f')}")
            if rel == "fused_reduce.json":
                big = max((r for r in data["rows"] if r["method"] == "fused"), key=lambda r: (r["bucket_mb"], r["tensors"]))
                self.headline("fused gradient-bucket pass, CPU", "unfused torch sequence of ZeRO-2/3",
                              f"{self.fig(big['speedup_vs_unfused'], '.1f')}x faster")
        self.plot("fused_reduce.png")

    def llama_gpu(self):
        self.start("A Llama on one GPU: ours against upstream",
                   "a Llama built from a config, bf16, AdamW, one GPU, one rank (`llama_gpu.py`): one engine at "
                   "each ZeRO stage with `loss.backward()`, and a ZeRO-2 student distilled from the same Llama as a frozen "
                   "ZeRO-3 teacher; each variant in its own process, rounds alternating which runs first",
                   "upstream `deepspeed.initialize` + `engine.backward(loss)` in the same layouts",
                   "BENCH_WORLD_SIZE=1 python benchmarks/llama_gpu.py --rounds 2 --trace")
        found = [(card, self.load(f"{card}/llama_gpu.json")) for card in self.cards()]
        found = [(card, data) for card, data in found if data is not None]
        if not found:
            self.missing("gpu/<card>/llama_gpu.json")
            return
        for card, data in found:
            m = data["meta"]
            self.out(self.machine(data, f"{card}/llama_gpu.json"), "",
                     f"{self.fig(m['hidden'], 'd')} hidden, {self.fig(m['layers'], 'd')} layers, vocabulary "
                     f"{self.fig(m['vocab'], ',d')}; micro-batch {self.fig(m['micro_bs'], 'd')} x "
                     f"{self.fig(m['seq'], 'd')} tokens; median step of {self.fig(m['steps'], 'd')} after "
                     f"{self.fig(m['warmup'], 'd')} warm-up. Ratio: the median over rounds of ours / upstream "
                     "(each round's own medians), with the rounds' range. States: `max_memory_allocated` after "
                     "`initialize`; peak: over the timed steps.", "")
            rows = []
            for r in data["rows"]:
                spread = (f"{self.fig(min(r['ratios']))}-{self.fig(max(r['ratios']))}" if len(r["ratios"]) > 1
                          else "one round")
                rows.append([r["layout"], self.fig(len(r["ratios"]), "d"), self.fig(r["upstream_ms"], ".1f"),
                             self.fig(r["ours_ms"], ".1f"), f"{self.fig(r['ratio'])} ({spread})",
                             self.opt(r["upstream_peak_mb"], ",.0f"), self.opt(r["ours_peak_mb"], ",.0f"),
                             self.opt(r["ours_states_mb"], ",.0f") if r["ours_states_mb"] == r["upstream_states_mb"]
                             else f"{self.opt(r['ours_states_mb'], ',.0f')} / {self.opt(r['upstream_states_mb'], ',.0f')}"])
            self.table(["layout", "rounds", "upstream ms", "ours ms", "ours / upstream (rounds' range)",
                        "upstream peak MiB", "ours peak MiB", "states MiB (ours / upstream, one if equal)"], rows)
            trace = self.results / card / "llama_trace_ours_z3.txt"
            if trace.exists():
                totals = dict(re.findall(r"^Self (CPU|CUDA) time total: ([\d.]+)ms$", trace.read_text(), flags=re.M))
                self.out(f"A profiler trace of one ZeRO-3 step of ours, [{trace.name}]({self.rel(f'{card}/{trace.name}')}) "
                         "(operator table) and `llama_trace_ours_z3.json.gz` (chrome://tracing), holds "
                         f"{self.fig(float(totals['CUDA']), '.1f')} ms of GPU work against "
                         f"{self.fig(float(totals['CPU']), '.1f')} ms of host time under the profiler: at this size "
                         "a ZeRO-3 step is the host's (hooks, gathers, launches), not the GPU's.", "")
            z3 = next((r for r in data["rows"] if r["key"] == "z3"), None)
            if z3:
                self.headline(f"a Llama on one {self.fig(m['gpu'])}, ZeRO-3 bf16: step time, peak memory",
                              "upstream `engine.backward(loss)`",
                              f"time {self.fig(z3['ratio'])}, peak {self.opt(z3['ours_peak_mb'], ',.0f')} vs "
                              f"{self.opt(z3['upstream_peak_mb'], ',.0f')} MiB")

    def reliability(self):
        self.start("Watchdog and rank-meeting cost",
                   "one engine (the overhead model), ours with the watchdog on and off, with the ranks' meeting "
                   "before an engine's collectives (`agree_before_collectives`, held only where the loop's recent "
                   "regions do not predict the region) on and off, and with the ZeRO-0/1 "
                   "rank-agreement check on and off",
                   "ours with the feature off, and upstream, interleaved in the same ranks",
                   "python benchmarks/overhead.py --watchdog && python benchmarks/overhead.py --meet && "
                   "python benchmarks/overhead.py --rank-agreement")
        rows = []
        for feature in ("watchdog", "meet", "rank_agreement"):
            rel = f"overhead_{feature}.json"
            data = self.result(rel)
            if data is None:
                continue
            for r in data["rows"]:
                raw = r["raw_ms"]
                off = "ours_off" if "ours_off" in raw else "ours_watchdog_off"  # the watchdog's older name for it
                rows.append([feature.replace("_", "-"), f"ZeRO-{r['stage']} {r['dtype']}",
                             self.ratio(raw["ours"], raw[off]), self.ratio(raw["ours"], raw["upstream"])])
        if rows:
            self.table(["feature", "config", "on / off (IQR)", "on / upstream (IQR)"], rows)

    def limits(self):
        self.section = "Limits and open gaps"
        self.out(f"## {self.section}", "")
        gaps = []
        growth = self.load("growth.json")
        if growth:
            worst = max(growth["engines"], key=lambda r: r["ratio"])
            gaps.append(f"Many ZeRO-3 engines under one loss are slower than one engine over the same modules: "
                        f"up to {self.fig(worst['ratio'])} of the super-module (N = {self.fig(worst['n'], 'd')}, "
                        f"stages {self.fig(worst['stages'])}, {worst['wiring']}). Each engine keeps its own reduction, norm "
                        f"all-reduce and update; [docs/design.md]({os.path.relpath(ROOT / 'docs' / 'design.md', self.out_dir)}#decisions) "
                        "says why they are "
                        "not joined.")
        mem = self.load("memory_breakdown.json")
        gap = self.memory_gap(mem) if mem else ""
        if gap:
            gaps.append(gap)
        e2e = self.load("fused_reduce_e2e.json")
        if e2e and not any(r.get("raw_ms") for r in e2e["rows"]):
            gaps.append("The fused path's end-to-end run kept medians only, no per-step times: its spread is unknown "
                        "until it is rerun.")
        if growth and not any("upstream" in r for r in growth["engines"]):
            gaps.append("DeepSpeed's own N engines are counted but not timed in these results.")
        cards = self.cards()
        gaps.append("Every GPU result here ran on one GPU, one rank: nothing in it measures communication across "
                    "ranks." if cards else "No GPU results.")
        gaps.append("CPU timings come from a shared two-core machine, two ranks on gloo: one run's ratio moves by a "
                    "few percent, so read the IQR beside each figure, not its last digit.")
        self.out(*(f"- {g}" for g in gaps), "")

    def machines(self):
        self.section = "Machines and files"
        self.out(f"## {self.section}", "")
        took = self.load("bench_time.json")
        if took is None:
            self.out("How long `make bench` takes: not measured (`bench_time.json` is not in these results).", "")
        else:
            m = took["meta"]
            slow = sorted(took["benchmarks"].items(), key=lambda kv: -kv[1])[:3]
            self.out(f"How long `make bench{' QUICK=1' if m.get('quick') else ''}` takes: "
                     f"{self.fig(took['total_s'] / 60, '.1f')} min on {self.fig(m.get('cpu') or 'an unknown CPU')}, "
                     f"{self.fig(m.get('cpus'), 'd')} cores ({self.fig(m.get('time'))}); the slowest: "
                     + ", ".join(f"{name} {self.fig(sec / 60, '.1f')} min" for name, sec in slow) + ".", "")
            if took.get("bf16_left_out"):
                mm = took["matmul_ms"]
                self.out(f"This CPU has no bf16 matmul kernels (one thread, {self.fig(mm['n'], 'd')} x {self.fig(mm['n'], 'd')}: "
                         f"{self.fig(mm['bf16'], '.1f')} ms "
                         f"in bf16 against {self.fig(mm['fp32'], '.1f')} ms in fp32), so a bf16 step here would time "
                         "PyTorch's fallback loop rather than the engines: this run left bf16 out (`BENCH_BF16=1` keeps "
                         "it). The GPU sections hold the bf16 figures.", "")
        self.out("Every result file this report read, by the machine line it holds:", "")
        machines = {}  # machine line -> (files, dates), in the order first seen
        files = sorted(self.results.glob("*.json")) + [f for card in self.cards()
                                                       for f in sorted((self.results / card).glob("*.json"))]
        for path in files:
            m = json.loads(path.read_text()).get("meta", {})
            line = (self.fig(m.get("cpu") or "unknown"), self.fig(m.get("cpus"), "d") if m.get("cpus") else "unknown",
                    self.fig(_gpu(m) or "-"), self.fig(m.get("torch")),
                    self.fig(m.get("deepspeed")) if m.get("deepspeed") else "unknown")
            names, dates = machines.setdefault(line, ([], []))
            names.append(f"`{path.relative_to(self.results)}`")
            dates.append(self.fig(m.get("time")) if m.get("time") else "unknown")
        rows = []
        for line, (names, dates) in machines.items():
            known = sorted(d for d in dates if d != "unknown")
            span = (known[0] if known[0] == known[-1] else f"{known[0]} to {known[-1]}") if known else "unknown"
            rows.append([", ".join(names), *line, span + (", unknown" if known and len(known) < len(dates) else "")])
        self.table(["files", "CPU", "cores", "GPU", "torch", "DeepSpeed", "dates"], rows)

    def render(self) -> str:
        self.section = "How to read this"
        self.out("# Performance", "",
                 "Generated by `benchmarks/render_report.py` from the JSON results under "
                 f"`{os.path.relpath(self.results, ROOT)}` (`make bench` reruns everything and this page; `make bench QUICK=1` is a short "
                 "run into `benchmarks/results/quick/`). Each claim says what is compared, against what, on which "
                 "machine, and the command that reruns it alone.", "",
                 "## How to read this", "",
                 "Every variant of a benchmark is built in the same ranks and stepped interleaved (the order rotates "
                 "each step), so load on the machine hits all of them alike. A ratio is ours / the baseline: the "
                 "median of per-step paired ratios, with their interquartile range (IQR) beside it; below one, ours "
                 "is faster or smaller. Peak memory: each variant alone in fresh processes; on CPU the resident-set "
                 "high-water mark above the start, on GPU the allocator's peak.", "")
        took = self.load("bench_time.json")
        if took and took.get("bf16_left_out"):
            self.out("The CPU of this run has no bf16 matmul kernels, so its CPU sections are fp32 only; "
                     "[Machines and files](#machines-and-files) says why.", "")
        for claim in (self.overhead, self.fused_path, self.growth, self.peers, self.parts, self.distillation,
                      self.rlhf, self.dpo, self.generation, self.counts, self.fused_ops, self.llama_gpu, self.reliability, self.limits,
                      self.machines):
            claim()
        return "\n".join(self.lines).rstrip() + "\n"

    def readme_table(self) -> str:
        self.section = "README"
        lines = [README_BEGIN, "| claim | baseline | figure |", "|---|---|---|"]
        lines += [f"| [{claim}](benchmarks/PERFORMANCE.md#{a}) | {base} | {fig} |" for claim, base, fig, a in self.summary]
        return "\n".join(lines + [README_END])


CLAIMS = ["Single-engine overhead against upstream", "Many small parameters: the fused path",
          "Engines in one loss: against the super-module and DeepSpeed's own engines",
          "Encoder to LLM against FSDP2: time and memory by buffer",
          "One model in parts: against whole-model ZeRO-3 and FSDP2", "Distillation", "RLHF step",
          "TRL DPO: the reference at its own stage", "Generation from a ZeRO-3 engine", "What one step issues", "Fused ops: CPU and GPU cards",
          "A Llama on one GPU: ours against upstream", "Watchdog and rank-meeting cost", "Limits and open gaps"]


def _gpu(meta):
    """The GPU a result's machine line names, None for a CPU run (a ``device`` is a GPU's name only where the
    line does not say ``gpu: false``)."""
    if meta.get("gpu"):
        return meta["gpu"]
    device = meta.get("device")
    return device if meta.get("gpu") is None and device not in (None, "cpu") else None


def _beside(data, variant, row):
    """The row of ``variant`` at ``row``'s size and dtype in a memory_breakdown result, None if it has none."""
    return next((x for x in data["rows"] if x["variant"] == variant
                 and (x["size"], x["dtype"]) == (row["size"], row["dtype"])), None)


def update_readme(path: Path, table: str) -> None:
    text = path.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < 0:
        raise SystemExit(f"{path}: the markers {README_BEGIN!r} ... {README_END!r} are missing")
    path.write_text(text[:start] + table + text[end + len(README_END):])
    print(f"wrote the performance table of {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=HERE / "results")
    ap.add_argument("--out", type=Path, default=None, help="default: <results>/../PERFORMANCE.md for the main "
                    "results, <results>/PERFORMANCE.md otherwise")
    ap.add_argument("--readme", type=Path, default=None, help="rewrite this README's performance table")
    args = ap.parse_args(argv)
    results = args.results.resolve()
    out = args.out or (HERE / "PERFORMANCE.md" if results == (HERE / "results").resolve() else results / "PERFORMANCE.md")
    report = Report(results, out.resolve().parent)
    out.write_text(report.render())
    print(f"wrote {out}")
    if args.readme:
        update_readme(args.readme, report.readme_table())


if __name__ == "__main__":
    main()
