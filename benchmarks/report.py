"""Write benchmarks/PERFORMANCE.md from benchmarks/results/*.json (run by benchmarks/run_all.sh).

The tables and RESULT lines come from the last run; the analysis text comes from
benchmarks/performance_notes.md (hand-written, kept as is).
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTIONS = [
    ("overhead", "Overhead on the single-engine path",
     "One engine, the same model: upstream `deepspeed.initialize` + `engine.backward(loss)` versus "
     "`deepspeed_multi.initialize` + `loss.backward()`, interleaved step by step in the same ranks."),
    ("zero3_grad_view", "ZeRO-3's update: the gradient buffer as a view, not a flattened copy",
     "One ZeRO-3 model, three variants interleaved: deepspeed_multi as shipped (the optimizer's fp32 gradient is "
     "a view of DeepSpeed's gradient partition buffer), deepspeed_multi with `DSM_ZERO3_GRAD_VIEW=0` (DeepSpeed's "
     "flattened copy), and upstream. Ratios are view / that variant, paired per step."),
    ("two_engines", "Two engines under one loss vs the super-module workaround",
     "Encoder (ZeRO-2) -> LLM (ZeRO-3) as two `deepspeed_multi` engines and one `loss.backward()`, versus both "
     "wrapped in one `nn.Module` in one upstream ZeRO-3 engine."),
    ("distillation", "Distillation: ZeRO-2 student + frozen ZeRO-3 teacher",
     "Teacher forward under `torch.no_grad()`; the same layouts with upstream engines as baseline, and both "
     "models at ZeRO-3."),
    ("rlhf_step", "RLHF step through four engines",
     "Actor (Z2) and critic (Z3) trained, reference and reward (Z3) frozen; the actor's output goes through the "
     "reward model with grad. Ours: one `loss.backward()`; upstream: `actor.backward` + `critic.backward`."),
    ("peers", "Peers: encoder -> LLM, both trained, against the super-module and FSDP2",
     "Ours (encoder ZeRO-2 + LLM ZeRO-3, two engines, one `loss.backward()`) against the upstream super-module at "
     "ZeRO-3 and PyTorch FSDP2 (`fully_shard` per block), AdamW fp32, at two sizes. Ratios are ours / that "
     "variant, paired per step (< 1: ours is faster or smaller)."),
    ("memory_breakdown", "Memory by buffer: encoder -> LLM against the super-module and FSDP2",
     "peers.py's workload in fp32 and bf16 (FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16, "
     "reduce_dtype=fp32)`), each variant alone in fresh processes: the tensors alive after the last backward "
     "(before `step()`), counted once per storage and put in a bucket by the attribute that holds them, the "
     "tensors the last forward saved for backward, the peak of live tensors in a step (the tensors alive at its start "
     "plus the net growth of torch.profiler's allocation events) "
     "and the phase it falls in, and the peak resident memory. "
     "Counted bytes are exact and machine-independent; a buffer allocated and never touched counts in full (a GPU "
     "allocates it) but is not resident on this CPU. 'ours, block-sized buckets' sets the LLM's "
     "`reduce_bucket_size`, `stage3_prefetch_bucket_size` and `stage3_max_reuse_distance` to one block's elements "
     "(`stage3_max_live_parameters` to two) and `sub_group_size` to one block's partition, as FSDP2 works per "
     "block."),
    ("parts", "One model, several ZeRO stages: the LLM at ZeRO-3 inside one model",
     "Vision tower -> projector -> LLM as one `nn.Module` under one loss: ours (`deepspeed_multi.submodules` puts "
     "the LLM at ZeRO-3, the rest of the model at ZeRO-2) against the whole model in one upstream ZeRO-3 engine "
     "(DeepSpeed's only way to have the LLM at ZeRO-3 without splitting the model) and PyTorch FSDP2 sharding only "
     "the LLM, at two sizes, fp32 and bf16; and peak memory while building the model: plainly, in "
     "`deepspeed_multi.zero_init` with the parted config, and in `deepspeed.zero.Init` for the whole model. Ratios "
     "are ours / that variant, paired per step (< 1: ours is faster or smaller)."),
    ("growth", "Growth: engines in one loss, and parameter count",
     "Step time as the number of engines under one loss grows (N = 1..16, chained and parallel; the engines "
     "ZeRO-2/3 alternating, all ZeRO-2 or all ZeRO-3), and as the parameter count of an encoder -> LLM pair grows "
     "from about 1e5 to 1e8, each beside one upstream ZeRO-3 engine holding the same modules."),
    ("counts", "What one step issues: collectives, operators, host syncs",
     "Hardware-independent cost of one step (counted, not timed; max over 2 ranks): collectives by kind with the "
     "bytes of their buffers, operators dispatched and host syncs (`.item()`-like), for ours (N engines, one "
     "`loss.backward()`), upstream (N `deepspeed.initialize` engines, one `loss.backward()`; RLHF: one "
     "`engine.backward` per trained engine) and the super-module (the N towers in one upstream ZeRO-3 engine), "
     "on growth.py's towers (N = 1..16, chained and parallel, the engines ZeRO-2/3 alternating, all ZeRO-2 or all "
     "ZeRO-3) and rlhf_step.py's step. Store meetings: our ranks' rendezvous before an engine's collectives "
     "(`agree_before_collectives`, gloo only), round trips the dispatcher does not see."),
    ("dpo_roles", "TRL DPO: the reference at its own ZeRO stage",
     "One `trl.DPOTrainer` step on a Llama built from a config: `multi_engine_trainer(DPOTrainer)` with the policy "
     "at ZeRO-2 and the reference at ZeRO-3 (`deepspeed_roles`), against the policy at ZeRO-3 (same reference) and "
     "plain TRL (policy ZeRO-2; TRL's `prepare_deepspeed` gives the reference stage 0), and our trainer without "
     "roles (TRL's stage-0 reference beside our ZeRO-2 policy: what our policy engine costs against upstream's). "
     "Each variant in fresh processes, not interleaved; ratios are ours Z2+Z3 / that variant (< 1: ours is "
     "faster or smaller). At 29.5M parameters on 2 CPU ranks the ZeRO-3 reference does not bring the peak below "
     "TRL's stage-0 replica (a replica is 118 MB here); it is for references whose replica does not fit "
     "(trl#1730: 7B), which this box cannot hold."),
]


def main():
    out = ["# Performance", "",
           "Regenerate everything below (tables, JSON and PNG plots under `benchmarks/results/`) with "
           "`make bench`, i.e. `benchmarks/run_all.sh`. Each script also runs alone: "
           "`python benchmarks/<name>.py --help`. Timings are never asserted on.", ""]
    meta = None
    for name, title, blurb in SECTIONS:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        meta = data["meta"]
        header = (RESULTS / f"{name}.txt").read_text() if (RESULTS / f"{name}.txt").exists() else ""
        setup = next((line for line in header.splitlines() if line.strip() and not line.startswith(("|", "  done",
                                                                                                        "wrote", "RESULT"))), "")
        out += [f"## {title}", "", blurb, "", f"_{setup.strip()}_" if setup else "", "", data["table"], "",
                f"`{data['result']}`", ""]
        if (RESULTS / f"{name}.png").exists():
            out += [f"![{name}](results/{name}.png)", ""]
    if meta:
        out += ["## Machine of the last run", "",
                ", ".join(f"{k}: {v}" for k, v in meta.items() if k in ("torch", "deepspeed", "python", "machine",
                                                                         "cpus", "gpu", "memory", "time")), ""]
    notes = HERE / "performance_notes.md"
    if notes.exists():
        out += [notes.read_text().rstrip(), ""]
    (HERE / "PERFORMANCE.md").write_text("\n".join(out))
    print(f"wrote {HERE.relative_to(HERE.parent) / 'PERFORMANCE.md'}")


if __name__ == "__main__":
    main()
