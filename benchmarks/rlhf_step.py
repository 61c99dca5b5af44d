"""One generation-free RLHF (PPO-style) step through four engines, time split per phase.

Engines: actor (trained, ZeRO-2), critic (trained, ZeRO-3), reference (frozen, ZeRO-3, forward
under no_grad) and reward (frozen, ZeRO-3; the actor's output goes THROUGH it with grad, so the
actor is trained by a gradient that crosses a frozen partitioned engine).

* ours:     ``deepspeed_multi`` engines, ONE ``(actor_loss + critic_loss).backward()``;
* upstream: ``deepspeed.initialize`` engines, ``actor.backward(actor_loss)`` then
  ``critic.backward(critic_loss)`` (the upstream API needs one backward per trained engine), and
  the reward model called as ``reward.module(act)``: upstream raises when a gradient goes through
  a frozen engine's forward.

Phases: fwd actor, fwd ref, fwd reward, fwd critic, backward, step (each synchronised, max over
ranks, median over steps). Peak memory per variant in fresh processes.

Prints a table and ``RESULT rlhf_ours_vs_upstream=<step time ratio> rlhf_backward_ours_vs_upstream=<..>``;
writes benchmarks/results/rlhf_step.json and .png.

Usage: python benchmarks/rlhf_step.py [--steps 15] [--warmup 3] [--no-memory]
"""
from __future__ import annotations

import copy

import _bench as B

D, LAYERS, SEQ, MICRO_BS = 256, 2, 32, 8
VARIANTS = ["upstream", "ours"]
PHASES = ["fwd actor", "fwd ref", "fwd reward", "fwd critic", "backward", "step"]


def _models():
    return {"actor": B.Tower(D, D, LAYERS, D, seed=1), "critic": B.Scalar(D, D, LAYERS, D, seed=2),
            "reference": B.Tower(D, D, LAYERS, D, seed=1), "reward": B.Scalar(D, D, LAYERS, D, seed=4)}


def _batch(i, dev):
    import torch
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(MICRO_BS, SEQ, D, generator=g).to(dev)


def _build(variant, models):
    import torch

    import deepspeed
    import deepspeed_multi
    ours = variant == "ours"
    init = deepspeed_multi.initialize if ours else deepspeed.initialize
    cfg = lambda stage: B.ds_config(stage, micro_bs=MICRO_BS)  # noqa: E731
    actor = B.build_engine(init, copy.deepcopy(models["actor"]), cfg(2))
    critic = B.build_engine(init, copy.deepcopy(models["critic"]), cfg(3))
    ref = B.build_engine(init, copy.deepcopy(models["reference"]), cfg(3), trainable=False)
    reward = B.build_engine(init, copy.deepcopy(models["reward"]), cfg(3), trainable=False)
    dev = B.device()

    def step(i):
        timer = B.PhaseTimer()
        x = _batch(i, dev)
        with timer("fwd actor"):
            act = actor(x)
        with timer("fwd ref"):
            with torch.no_grad():
                ref_out = ref(x)
        with timer("fwd reward"):
            # differentiable through the frozen ZeRO-3 reward model. Upstream refuses a gradient through
            # a frozen engine's forward ("Direct calls to tensor.backward() are not supported ..."
            # from the reward engine's output hook), so the baseline calls its module directly,
            # past the engine (ZeRO-3's gather hooks live on the module and still work).
            r = reward(act) if ours else reward.module(act)
        with timer("fwd critic"):
            value = critic(x)
        actor_loss = -r.mean() + 0.1 * ((act - ref_out)**2).mean()
        critic_loss = ((value - r.detach())**2).mean()
        with timer("backward"):
            if ours:
                (actor_loss + critic_loss).backward()
            else:
                actor.backward(actor_loss)
                critic.backward(critic_loss)
        with timer("step"):
            actor.step()
            critic.step()
        return timer.phases
    return step


def timing(warmup, steps):
    models = _models()
    return B.interleave({v: _build(v, models) for v in VARIANTS}, warmup, steps)


def memory(variant, steps):
    models = _models()
    return B.peak_memory_of_steps(lambda: _build(variant, models), steps)


def main():
    ap = B.arg_parser(__doc__)
    args = ap.parse_args()
    t = B.launch(timing, args.warmup, args.steps)[0]
    med = {v: {p: B.median(t[v][p]) for p in PHASES + ["total"]} for v in VARIANTS}
    mem = {} if args.no_memory else {v: B.launch(memory, v, 2)[0] for v in VARIANTS}
    rows = []
    for p in PHASES + ["total"]:
        up, ours = med["upstream"][p], med["ours"][p]
        rows.append([p, f"{up:.1f}", f"{ours:.1f}", f"{B.paired_ratio(t['ours'][p], t['upstream'][p]):.3f}"])
    if mem:
        rows.append(["peak MiB/rank", f"{mem['upstream']:.1f}", f"{mem['ours']:.1f}",
                     f"{mem['ours'] / mem['upstream']:.3f}"])
    table = B.fmt_table(["phase (ms, median)", "upstream (2 backward calls)", "ours (1 loss.backward)",
                         "ours/upstream (paired)"], rows)
    models = _models()
    sizes = ", ".join(f"{k} {B.n_params(m) / 1e6:.2f}M" for k, m in models.items())
    print(f"\nRLHF step, 4 engines (actor Z2, critic Z3, reference Z3 frozen, reward Z3 frozen; {sizes}), "
          f"micro-batch {MICRO_BS}x{SEQ}, 2 ranks, median of {args.steps} steps after {args.warmup} warm-up "
          f"(phase medians need not add up to the total median); memory = {B.memory_kind()}\n")
    print(table)
    result = (f"RESULT rlhf_ours_vs_upstream={B.paired_ratio(t['ours']['total'], t['upstream']['total']):.3f} "
              f"rlhf_backward_ours_vs_upstream={B.paired_ratio(t['ours']['backward'], t['upstream']['backward']):.3f}")
    if mem:
        result += f" mem_rlhf_ours_vs_upstream={mem['ours'] / mem['upstream']:.3f}"

    def plot(plt):
        import numpy as np
        fig, ax = plt.subplots(figsize=(6, 3.2))
        left = np.zeros(len(VARIANTS))
        for p in PHASES:
            vals = np.array([med[v][p] for v in VARIANTS])
            ax.barh(VARIANTS, vals, left=left, label=p)
            left += vals
        ax.set_xlabel("ms (median per phase)")
        ax.set_title("RLHF step through four engines")
        ax.legend(fontsize=7, ncol=3)
        return fig

    B.save("rlhf_step", {"meta": B.meta(steps=args.steps, warmup=args.warmup), "median_ms": med, "peak_mb": mem,
                         "raw_ms": t, "table": table, "result": result}, plot)
    print(result)


if __name__ == "__main__":
    main()
