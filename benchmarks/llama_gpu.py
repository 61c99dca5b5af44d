"""Ours vs upstream on a Llama that keeps a GPU busy: one engine, and a distillation pair.

A Llama built from a config (random weights; about 0.37B parameters by default), bf16, AdamW, on one
GPU (one rank, NCCL). Each variant runs in its OWN process, so that one variant's allocator state and
peak cannot leak into the other's (two 0.4B engines with their optimizer states do not fit one process
comfortably); runs are paired by alternating their order (round 1: ours then upstream, round 2:
upstream then ours, ...), and the ratio is the median of the per-round ratios of the median step times.

* one engine, ZeRO 1, 2, 3: ``deepspeed.initialize`` + ``engine.backward(loss)`` (upstream) against
  ``deepspeed_multi.initialize`` + ``loss.backward()`` (ours);
* distillation: a half-depth student at ZeRO-2 and the full model as a frozen teacher at ZeRO-3 (its
  forward under no_grad), KL to the teacher plus cross-entropy.

Per process: the median and IQR of the step time (fwd + bwd + step, synchronized) after warm-up,
``torch.cuda.max_memory_allocated`` after initialize (model states) and over the steps.
``--trace``: one extra process of ours at ZeRO-3 records a torch.profiler trace of one step
(``llama_trace_ours_z3.json.gz``) and its operator table (``llama_trace_ours_z3.txt``).
Writes ``$BENCH_RESULTS/llama_gpu.json``; prints a table and ``RESULT llama_ours_vs_upstream_z<k>=..``.

Usage: BENCH_WORLD_SIZE=1 python benchmarks/llama_gpu.py [--rounds 2] [--steps 10] [--warmup 3]
                                                        [--stages 1 2 3] [--no-distill] [--trace]
"""
from __future__ import annotations

import gzip
import os
import shutil
import statistics

import _bench as B

# BENCH_LLAMA_SIZE=tiny: a few-MB model for a smoke run on CPU.
HIDDEN, LAYERS, HEADS, INTER, VOCAB = ((64, 2, 4, 128, 512) if os.environ.get("BENCH_LLAMA_SIZE") == "tiny"
                                       else (1024, 24, 16, 2816, 32000))
SEQ = int(os.environ.get("BENCH_LLAMA_SEQ", "512"))
MICRO_BS = int(os.environ.get("BENCH_LLAMA_MICRO_BS", "4"))


def _llama(layers, seed):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, intermediate_size=INTER, vocab_size=VOCAB,
                      max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(B.device()):
        return LlamaForCausalLM(cfg)


def _batch(i, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, VOCAB, (MICRO_BS, SEQ), generator=g).to(dev)


def _single(ours, stage):
    import deepspeed
    import deepspeed_multi
    init = deepspeed_multi.initialize if ours else deepspeed.initialize
    engine = B.build_engine(init, _llama(LAYERS, 1), B.ds_config(stage, "bf16", micro_bs=MICRO_BS))
    dev = B.device()

    def step(i):
        ids = _batch(i, dev)
        loss = engine(input_ids=ids, labels=ids).loss
        loss.backward() if ours else engine.backward(loss)
        engine.step()
    return step


def _distill(ours, stage):
    import torch
    import torch.nn.functional as F

    import deepspeed
    import deepspeed_multi
    init = deepspeed_multi.initialize if ours else deepspeed.initialize
    student = B.build_engine(init, _llama(LAYERS // 2, 1), B.ds_config(2, "bf16", micro_bs=MICRO_BS))
    teacher = B.build_engine(init, _llama(LAYERS, 2), B.ds_config(3, "bf16", micro_bs=MICRO_BS), trainable=False)
    dev = B.device()

    def step(i):
        ids = _batch(i, dev)
        with torch.no_grad():
            t_logits = teacher(input_ids=ids).logits.float()
        out = student(input_ids=ids, labels=ids)
        kd = F.kl_div(F.log_softmax(out.logits.float(), -1), F.log_softmax(t_logits, -1), log_target=True,
                      reduction="batchmean")
        loss = out.loss + kd
        loss.backward() if ours else student.backward(loss)
        student.step()
    return step


def run_variant(kind, ours, stage, warmup, steps, trace_to=None):
    """In a fresh rank: build one variant, time it, report its memory (and optionally trace one step)."""
    import torch
    build = _single if kind == "single" else _distill
    step = build(ours, stage)
    B.sync()
    states_mb = torch.cuda.max_memory_allocated() / B.MB if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = B.interleave({"v": step}, warmup, steps)["v"]["total"]
    peak_mb = torch.cuda.max_memory_allocated() / B.MB if torch.cuda.is_available() else None
    if trace_to:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts, record_shapes=False) as prof:
            step(warmup + steps)
            B.sync()
        raw = trace_to + ".json"
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        with open(trace_to + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=40))
    return {"ms": times, "median_ms": statistics.median(times), "iqr_ms": B.iqr(times), "states_mb": states_mb,
            "peak_mb": peak_mb}


def main():
    ap = B.arg_parser(__doc__)
    ap.set_defaults(steps=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--no-distill", action="store_true")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    configs = [("single", s) for s in args.stages] + ([] if args.no_distill else [("distill", 2)])
    runs = {}
    payload = {"meta": B.meta(steps=args.steps, warmup=args.warmup, rounds=args.rounds, seq=SEQ, micro_bs=MICRO_BS,
                              hidden=HIDDEN, layers=LAYERS, vocab=VOCAB), "rows": []}

    def label(kind, stage):
        return f"ZeRO-{stage}" if kind == "single" else "distill Z2 student + Z3 teacher"

    for r in range(args.rounds):
        for kind, stage in configs:
            for ours in ((True, False) if r % 2 == 0 else (False, True)):
                res = B.launch(run_variant, kind, ours, stage, args.warmup, args.steps, timeout_s=300)[0]
                runs.setdefault((kind, stage), {"ours": [], "upstream": []})["ours" if ours else "upstream"].append(res)
                print(f"round {r} {label(kind, stage)} {'ours' if ours else 'upstream'}: {res['median_ms']:.1f} ms, "
                      f"states {res['states_mb']} MiB, peak {res['peak_mb']} MiB", flush=True)
            payload["rows"] = _rows(runs, label)
            B.save("llama_gpu", payload)  # after every pair: a run cut short keeps what it measured
    if args.trace:
        B.launch(run_variant, "single", True, 3, args.warmup, 2, str(B.RESULTS / "llama_trace_ours_z3"),
                 timeout_s=300)
        print(f"wrote {B.RESULTS / 'llama_trace_ours_z3'}.json.gz and .txt")
    rows = payload["rows"]
    table = B.fmt_table(["layout", "upstream ms", "ours ms", "ours/upstream (paired)", "upstream peak MiB",
                         "ours peak MiB", "upstream states MiB", "ours states MiB"],
                        [[x["layout"], f"{x['upstream_ms']:.1f}", f"{x['ours_ms']:.1f}", f"{x['ratio']:.3f}"]
                         + [_mb(x[k]) for k in ("upstream_peak_mb", "ours_peak_mb", "upstream_states_mb",
                                                "ours_states_mb")] for x in rows])
    payload["table"] = table
    B.save("llama_gpu", payload)
    print(f"\nLlama {HIDDEN}x{LAYERS} (vocab {VOCAB}), bf16, micro-batch {MICRO_BS}x{SEQ}, one rank; each variant in "
          f"its own process, {args.rounds} alternating rounds, median of {args.steps} steps after {args.warmup}\n")
    print(table)
    print("RESULT " + " ".join(f"llama_ours_vs_upstream_{x['key']}={x['ratio']:.3f}" for x in rows))


def _mb(v):
    return "-" if v is None else f"{v:.0f}"


def _rows(runs, label):
    rows = []
    for (kind, stage), v in runs.items():
        n = min(len(v["ours"]), len(v["upstream"]))
        if n == 0:
            continue
        ratios = [v["ours"][i]["median_ms"] / v["upstream"][i]["median_ms"] for i in range(n)]

        def med(side, key):
            vals = [x[key] for x in v[side][:n] if x[key] is not None]  # no allocator figures on CPU
            return statistics.median(vals) if vals else None

        rows.append({"layout": label(kind, stage), "key": f"z{stage}" if kind == "single" else "distill",
                     "ratio": statistics.median(ratios), "ratios": ratios,
                     "ours_ms": med("ours", "median_ms"), "upstream_ms": med("upstream", "median_ms"),
                     "ours_peak_mb": med("ours", "peak_mb"), "upstream_peak_mb": med("upstream", "peak_mb"),
                     "ours_states_mb": med("ours", "states_mb"), "upstream_states_mb": med("upstream", "states_mb"),
                     "runs": v})
    return rows


if __name__ == "__main__":
    main()
