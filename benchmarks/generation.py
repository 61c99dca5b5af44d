"""Generation from a ZeRO-3 engine: tokens per second with and without the generation mode, beside the same
model unsharded and upstream's ZeRO-3 ``module.generate``.

A Llama built from a config (6 layers, width 256), a batch of 4 prompts of 16 tokens, 48 new tokens,
greedy, on 2 ranks (each rank its own prompts). The variants, built side by side in one pair of processes
and run interleaved (see _bench's Note):

* unsharded: the model as a plain module on every rank, ``model.generate``;
* ours, generation mode: a frozen ZeRO-3 MultiEngine, ``engine.module.generate`` (the default: the whole
  model gathered once, no per-module hooks: [Note: generation from a ZeRO-3 engine]);
* ours, per module: the same with ``generation_gather_bytes: 0`` (every forward gathers module by module,
  ``synced_gpus`` on);
* upstream: ``deepspeed.initialize``'s ZeRO-3 engine, ``engine.module.generate(synced_gpus=True)``;
* upstream, gathered: the same inside ``deepspeed.zero.GatheredParameters`` over every parameter (ZeRO-3's
  module hooks still run).

Every variant's output is checked equal to the unsharded model's. Peak memory per rank: each variant alone
in fresh processes. Prints a table and ``RESULT generation_mode_vs_unsharded=<time ratio>
generation_per_module_vs_unsharded=<..> generation_upstream_vs_unsharded=<..>``; writes
benchmarks/results/generation.json.

Usage: python benchmarks/generation.py [--steps 5] [--warmup 1] [--no-memory] [--new-tokens 48]
"""
from __future__ import annotations

import copy

import _bench as B

LAYERS, WIDTH, VOCAB, BATCH, PROMPT = 6, 256, 1024, 4, 16
VARIANTS = ["unsharded", "ours, generation mode", "ours, per module", "upstream", "upstream, gathered"]


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _prompt(i):
    import torch
    import deepspeed.comm as dist
    g = torch.Generator().manual_seed(100 * i + dist.get_rank())
    return torch.randint(3, VOCAB, (BATCH, PROMPT), generator=g)


def _config(bound=None):
    cfg = B.ds_config(3, micro_bs=BATCH)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    if bound is not None:
        cfg["deepspeed_multi"] = {"generation_gather_bytes": bound}
    return cfg


def _build(variant, model, new_tokens, outputs):
    """A callable(i) that generates once for ``variant``; each output is kept in ``outputs[variant]``."""
    import torch
    import deepspeed
    import deepspeed_multi
    model = copy.deepcopy(model)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if variant == "unsharded":
        model.to(B.device())  # where the engines put their modules (a GPU's where one is set up)
        run = lambda ids: model.generate(ids, **kw)  # noqa: E731
    elif variant.startswith("ours"):
        engine = deepspeed_multi.initialize(model=model, config=_config(0 if "per module" in variant else None))[0]
        run = lambda ids: engine.module.generate(ids, **kw)  # noqa: E731
    else:
        engine = deepspeed.initialize(model=model, config=_config())[0]
        if variant == "upstream":
            run = lambda ids: engine.module.generate(ids, synced_gpus=True, **kw)  # noqa: E731
        else:
            def run(ids):
                with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                    return engine.module.generate(ids, synced_gpus=True, **kw)

    def step(i):
        with torch.no_grad():
            outputs.setdefault(variant, []).append(run(_prompt(i).to(B.device())).cpu())
    return step


def timing(warmup, steps, new_tokens):
    model = _model()
    outputs = {}
    t = B.interleave({v: _build(v, model, new_tokens, outputs) for v in VARIANTS}, warmup, steps)
    import torch
    for v in VARIANTS:
        for got, want in zip(outputs[v], outputs["unsharded"]):
            assert torch.equal(got, want), f"{v}: generated tokens differ from the unsharded model's"
    return {k: v["total"] for k, v in t.items()}


def memory(variant, steps, new_tokens):
    model = _model()
    return B.peak_memory_of_steps(lambda: _build(variant, model, new_tokens, {}), steps)


def main():
    ap = B.arg_parser(__doc__)
    ap.set_defaults(steps=5, warmup=1)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    t = B.launch(timing, args.warmup, args.steps, args.new_tokens)[0]
    med = {v: B.median(t[v]) for v in VARIANTS}
    mem = {} if args.no_memory else {v: B.launch(memory, v, 2, args.new_tokens)[0] for v in VARIANTS}
    tokens = BATCH * args.new_tokens
    rows, data = [], []
    for v in VARIANTS:
        rec = {"variant": v, "ms": med[v], "iqr_ms": B.iqr(t[v]), "tokens_per_s": tokens / (med[v] / 1e3),
               "time_vs_unsharded": B.paired_ratio(t[v], t["unsharded"]), "peak_mb": mem.get(v), "raw_ms": t[v]}
        if mem:
            rec["mem_vs_unsharded"] = mem[v] / mem["unsharded"]
        data.append(rec)
        rows.append([v, f"{med[v]:.0f} ±{rec['iqr_ms']:.0f}", f"{rec['tokens_per_s']:.0f}",
                     f"{rec['time_vs_unsharded']:.2f}", f"{mem[v]:.1f}" if mem else "-",
                     f"{rec['mem_vs_unsharded']:.2f}" if mem else "-"])
    table = B.fmt_table(["variant", "ms per generate (IQR)", "tokens/s per rank", "time vs unsharded (paired)",
                         "peak MiB/rank", "memory vs unsharded"], rows)
    n = B.n_params(_model())
    print(f"\nGeneration from a ZeRO-3 engine: Llama {n / 1e6:.2f}M params ({LAYERS} layers, width {WIDTH}), "
          f"batch {BATCH}, {PROMPT}-token prompts, {args.new_tokens} new tokens, greedy, 2 ranks, median of "
          f"{args.steps} generations after {args.warmup} warm-up; memory = {B.memory_kind()}\n")
    print(table)
    by = {r["variant"]: r for r in data}
    result = (f"RESULT generation_mode_vs_unsharded={by['ours, generation mode']['time_vs_unsharded']:.3f} "
              f"generation_per_module_vs_unsharded={by['ours, per module']['time_vs_unsharded']:.3f} "
              f"generation_upstream_vs_unsharded={by['upstream']['time_vs_unsharded']:.3f} "
              f"generation_upstream_gathered_vs_unsharded={by['upstream, gathered']['time_vs_unsharded']:.3f}")
    B.save("generation", {"meta": B.meta(steps=args.steps, warmup=args.warmup, new_tokens=args.new_tokens,
                                         params=n, layers=LAYERS, width=WIDTH, batch=BATCH, prompt=PROMPT),
                          "rows": data, "table": table, "result": result})
    print(result)


if __name__ == "__main__":
    main()
