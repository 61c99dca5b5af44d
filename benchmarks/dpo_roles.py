"""TRL DPO: the reference at its own ZeRO stage (``deepspeed_roles``) against what TRL does alone.

One ``trl.DPOTrainer`` training step (policy forward + backward on chosen and rejected, the frozen
reference's forward under no_grad, AdamW update) on a Llama built from a config (random weights,
a word-level tokenizer built locally, an in-memory preference dataset; nothing is downloaded):

* ours Z2+Z3:        ``deepspeed_multi.transformers.multi_engine_trainer(DPOTrainer)``, policy at
                     ZeRO-2 (``DPOConfig(deepspeed=...)``), reference at ZeRO-3 through
                     ``deepspeed_roles={"ref_model": {"zero_optimization": {"stage": 3}}}``;
* ours Z3+Z3:        the same trainer with the policy at ZeRO-3 and the SAME ``deepspeed_roles``
                     (so the reference engine is built exactly as in Z2+Z3 and only the policy's
                     stage differs); this is what one global ZeRO-3 stage gives both models;
* TRL default Z2+Z0: plain ``DPOTrainer``, policy at ZeRO-2 under upstream Accelerate/DeepSpeed;
                     TRL's ``prepare_deepspeed`` copies the policy's config and forces the
                     reference to stage 0 (a full replica on every rank) unless the policy is at ZeRO-3;
* ours Z2+Z0:        our trainer with no ``deepspeed_roles`` (TRL's own stage-0 reference beside our
                     ZeRO-2 policy): separates what the ZeRO-3 reference costs from what our policy
                     engine costs against upstream's.

The models are built after the ``DPOConfig``, as a user's ``from_pretrained`` would be: under
``zero.Init`` (partitioned at construction) when the policy's config is ZeRO-3, whole otherwise;
ours Z2+Z3 builds its ZeRO-3 reference under ``deepspeed_multi.zero_init`` (partitioned as built).
The config has ``stage3_param_persistence_threshold = 10 * hidden`` (TRL's choice for its own
ZeRO-3 reference); our ZeRO-3 reference also gets the bucket and prefetch sizes TRL means to give
it (see ``_ref_role``). AdamW (the Trainer's), ``max_grad_norm`` 1.0, no gradient checkpointing.

How it is measured (unlike the other benchmarks, the variants are NOT interleaved: ``Trainer.train``
owns the loop): each variant runs alone in a fresh pair of processes, which gives both numbers.
* Step time: a ``TrainerCallback`` takes ``time.perf_counter`` at ``on_step_begin`` and
  ``on_step_end`` (data collation, forward/backward of every micro-batch, clipping, the update,
  the scheduler, zero_grad: the Trainer's own per-step work included; its logging after
  ``on_step_end`` is not). Per step the max over ranks; the table gives the median over the
  timed steps after the warm-up, and the ratios are ratios of those medians (not paired).
  The JSON also holds the step-to-step interval (``on_step_end`` to ``on_step_end``, logging and
  batch fetching included).
* Peak memory per rank: ``_bench.PeakMemory`` from just before the models are built to the end of
  ``train()`` (CPU: VmHWM minus VmRSS before the build; see _bench's Note), max over ranks.
``--no-memory`` is accepted (run_all.sh passes it to every script) but changes nothing: memory
comes from the same processes as time at no extra cost.

Prints a table (one column per variant) and ``RESULT dpo_z2z3_vs_z3z3=<time> dpo_z2z3_vs_trl_default=<time>
mem_dpo_z2z3_vs_z3z3=<memory> mem_dpo_z2z3_vs_trl_default=<memory>`` (ours Z2+Z3 / that variant;
< 1: ours Z2+Z3 is faster or smaller); writes benchmarks/results/dpo_roles.json and .png.

Usage: python benchmarks/dpo_roles.py [--size small|large] [--steps 8] [--warmup 2] [--dtype fp32|bf16]
(``--size small`` is a smoke test of about a minute; the default ``large`` takes several minutes on 2 CPU cores.)
"""
from __future__ import annotations

import _bench as B

# Llama sizes. prompt/completion are words (= tokens); TRL appends EOS to each completion, so a
# chosen or rejected sequence is prompt + completion + 1 tokens. micro_bs pairs per rank and step
# (DPO runs chosen and rejected as one batch of 2 * micro_bs sequences).
SIZES = {
    "small": dict(hidden=128, layers=2, intermediate=344, heads=4, vocab=512, prompt=16, completion=15, micro_bs=2),
    "large": dict(hidden=512, layers=8, intermediate=1376, heads=8, vocab=4096, prompt=32, completion=31, micro_bs=4),
}
VARIANTS = ["ours Z2+Z3", "ours Z3+Z3", "TRL default Z2+Z0", "ours Z2+Z0"]


def _ref_role(hidden):
    """The reference at ZeRO-3 with the tuning TRL's ``prepare_deepspeed`` means to give a ZeRO-3
    reference (it writes these keys dotted, ``"zero_optimization.reduce_bucket_size"``, and
    DeepSpeed ignores them): buckets and prefetch of about one hidden x hidden matrix, so a forward
    gathers a layer or two at a time instead of DeepSpeed's default 5e7-element prefetch (the
    whole of this model)."""
    return {"ref_model": {"zero_optimization": {
        "stage": 3, "reduce_bucket_size": hidden * hidden, "stage3_param_persistence_threshold": 10 * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden)}}}
WORLD = 2


def _policy_stage(variant):
    return 3 if "Z3+Z3" in variant else 2


def _ds_config(stage, hidden):
    """The policy's DeepSpeed config; "auto" entries are filled from the DPOConfig by Transformers."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10 * hidden}}


def _llama(s):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                      max_position_embeddings=2 * (s["prompt"] + s["completion"] + 1), pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_dropout=0.0)
    return AutoModelForCausalLM.from_config(cfg)


def _tokenizer(vocab):
    """A word-level tokenizer over ``w3 .. w{vocab-1}`` plus pad/bos/eos, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _preferences(s, n, seed=3):
    import torch
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(3, s["vocab"], (k, ), generator=g))
    return Dataset.from_list([{"prompt": words(s["prompt"]), "chosen": words(s["completion"]),
                               "rejected": words(s["completion"])} for _ in range(n)])


def run_variant(variant, size, dtype, warmup, steps):
    """One DPO run of ``warmup + steps`` steps on this rank; returns step times, peak memory and losses."""
    import os
    import shutil
    import tempfile
    import time

    import torch
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    import deepspeed.comm as dist
    from deepspeed_multi.transformers import multi_engine_trainer

    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        os.environ.pop(key, None)
    s = SIZES[size]
    ours = variant.startswith("ours")
    trainer_cls = multi_engine_trainer(DPOTrainer) if ours else DPOTrainer
    tokenizer, data = _tokenizer(s["vocab"]), _preferences(s, (warmup + steps) * s["micro_bs"] * WORLD)
    out = tempfile.mkdtemp(prefix="dsm_dpo_bench_")
    # Before the models: with a ZeRO-3 policy config, from_config builds them under zero.Init.
    args = DPOConfig(output_dir=out, per_device_train_batch_size=s["micro_bs"], gradient_accumulation_steps=1,
                     max_steps=warmup + steps, learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=1.0,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=not B.use_gpu(WORLD),
                     bf16=dtype == "bf16", gradient_checkpointing=False, seed=0, data_seed=0,
                     dataloader_drop_last=True, disable_tqdm=True, beta=0.1, max_length=None,
                     deepspeed=_ds_config(_policy_stage(variant), s["hidden"]))

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0, self.ms, self.ends = None, [], []

        def on_step_begin(self, args, state, control, **kw):
            B.sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            B.sync()
            t = time.perf_counter()
            self.ms.append((t - self.t0) * 1e3)
            self.ends.append(t)

    timer = StepTimer()
    mem = B.PeakMemory()
    torch.manual_seed(0)
    policy = _llama(s)
    role = _ref_role(s["hidden"]) if ours and variant.endswith("+Z3") else None
    if role and _policy_stage(variant) != 3:
        # As a user of deepspeed_roles would: the ZeRO-3 reference is partitioned as it is built
        # (deepspeed_multi.zero_init), never whole on a rank, then given the policy's weights one
        # parameter at a time.
        import deepspeed
        import deepspeed_multi
        with deepspeed_multi.zero_init({"train_micro_batch_size_per_gpu": s["micro_bs"], **role["ref_model"]}):
            reference = _llama(s)
        for p, q in zip(reference.parameters(), policy.parameters()):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if dist.get_rank() == 0:
                    p.data.copy_(q.data)
    else:
        torch.manual_seed(0)
        reference = _llama(s)  # the same weights as the policy (same seed, same construction)
    params = B.n_params(policy)
    kw = {"deepspeed_roles": role} if role else {}
    trainer = trainer_cls(model=policy, ref_model=reference, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer], **kw)
    trainer.train()
    peak = mem.peak_mb()

    # What was built: (trains, ZeRO stage) of the policy and the reference engine.
    ref = trainer.ref_model
    stages = {"policy": trainer.model_wrapped.zero_optimization_stage(), "reference": ref.zero_optimization_stage(),
              "reference_engine": type(ref).__module__.split(".")[0],
              "dtype": str(next(trainer.model_wrapped.module.parameters()).dtype).replace("torch.", "")}
    intervals = [(b - a) * 1e3 for a, b in zip(timer.ends, timer.ends[1:])]
    per_step = {}
    for name, vals in (("ms", timer.ms), ("interval_ms", intervals)):
        t = torch.tensor(vals, dtype=torch.float64, device=B.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        per_step[name] = t.tolist()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    shutil.rmtree(out, ignore_errors=True)
    return {"ms": per_step["ms"][warmup:], "interval_ms": per_step["interval_ms"][max(warmup - 1, 0):],
            "peak_mb": peak, "stages": stages, "losses": losses, "params": params}


def main():
    ap = B.arg_parser(__doc__)
    ap.add_argument("--size", choices=list(SIZES), default="large")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.set_defaults(steps=8, warmup=2)
    args = ap.parse_args()
    s = SIZES[args.size]
    runs = {}
    for v in VARIANTS:  # each variant in its own fresh pair of processes
        runs[v] = B.launch(run_variant, v, args.size, args.dtype, args.warmup, args.steps, timeout_s=1800)[0]
        print(f"  done {v}: {B.median(runs[v]['ms']):.1f} ms/step, {runs[v]['peak_mb']:.1f} MiB/rank, "
              f"stages {runs[v]['stages']}", flush=True)
    ours = VARIANTS[0]
    med = {v: B.median(runs[v]["ms"]) for v in VARIANTS}
    mem = {v: runs[v]["peak_mb"] for v in VARIANTS}
    data = []
    for v in VARIANTS:
        r = runs[v]
        data.append({"variant": v, "ms": med[v], "iqr_ms": B.iqr(r["ms"]), "raw_ms": r["ms"],
                     "interval_ms": B.median(r["interval_ms"]) if r["interval_ms"] else None,
                     "raw_interval_ms": r["interval_ms"], "peak_mb": mem[v], "time_ours_over_this": med[ours] / med[v],
                     "mem_ours_over_this": mem[ours] / mem[v], "stages": r["stages"], "losses": r["losses"]})
    by = {d["variant"]: d for d in data}
    rows = [
        ["policy + reference ZeRO stage"] + [f"Z{by[v]['stages']['policy']} + Z{by[v]['stages']['reference']}"
                                             for v in VARIANTS],
        ["ms/step (median ±IQR)"] + [f"{by[v]['ms']:.1f} ±{by[v]['iqr_ms']:.1f}" for v in VARIANTS],
        ["ours Z2+Z3 / this (time)"] + ["-" if v == ours else f"{by[v]['time_ours_over_this']:.3f}" for v in VARIANTS],
        ["peak MiB/rank"] + [f"{mem[v]:.1f}" for v in VARIANTS],
        ["ours Z2+Z3 / this (memory)"] + ["-" if v == ours else f"{by[v]['mem_ours_over_this']:.3f}" for v in VARIANTS],
        ["first / last logged loss"] + [f"{by[v]['losses'][0]:.4f} / {by[v]['losses'][-1]:.4f}" for v in VARIANTS],
    ]
    table = B.fmt_table([""] + VARIANTS, rows)
    seq = s["prompt"] + s["completion"] + 1
    print(f"\nTRL DPO step: Llama {runs[ours]['params'] / 1e6:.1f}M params (policy; the reference is a copy), hidden "
          f"{s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, micro-batch {s['micro_bs']} pairs x {seq} tokens, "
          f"{args.dtype}, AdamW, 2 ranks on {'GPU' if B.use_gpu(WORLD) else 'CPU'}; each variant in fresh processes, "
          f"median of {args.steps} steps after {args.warmup} warm-up; memory = {B.memory_kind()}\n")
    print(table)
    z3, trl = VARIANTS[1], VARIANTS[2]
    result = (f"RESULT dpo_z2z3_vs_z3z3={med[ours] / med[z3]:.3f} dpo_z2z3_vs_trl_default={med[ours] / med[trl]:.3f} "
              f"mem_dpo_z2z3_vs_z3z3={mem[ours] / mem[z3]:.3f} mem_dpo_z2z3_vs_trl_default={mem[ours] / mem[trl]:.3f}")

    def plot(plt):
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.4))
        for ax, vals, label in ((ax_t, med, "ms / step (median)"), (ax_m, mem, "peak MiB / rank")):
            ax.bar(range(len(VARIANTS)), [vals[v] for v in VARIANTS], color=["C0", "C1", "C2", "C3"])
            ax.set_xticks(range(len(VARIANTS)))
            ax.set_xticklabels([v.replace(" Z", "\nZ", 1) for v in VARIANTS], fontsize=8)
            ax.set_ylabel(label)
        fig.suptitle(f"TRL DPO step, policy + reference stages ({args.size}, {args.dtype})")
        return fig

    B.save("dpo_roles", {"meta": B.meta(steps=args.steps, warmup=args.warmup, size=args.size, dtype=args.dtype,
                                        model=s), "rows": data, "table": table, "result": result}, plot)
    print(result)


if __name__ == "__main__":
    main()
