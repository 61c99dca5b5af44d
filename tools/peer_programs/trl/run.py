"""TRL's own scripts, launched as TRL documents them, upstream and with deepspeed_multi, compared bit for bit.

    python tools/peer_programs/trl/run.py --out <results dir> [--trl-src <a TRL checkout>]
        [--scripts sft,dpo,...] [--stages 1,2,3] [--timeout S]

What runs: each script under ``accelerate launch --config_file <TRL's zeroN.yaml> <script> ...``, the yaml TRL
ships in ``trl/accelerate_configs/`` with only ``num_processes`` set to 2 (TRL's launcher configs run bf16 with
its DeepSpeed plugin); the script gets ``--use_cpu True`` (TRL on CPU) and a tiny job. Scripts: ``trl/scripts/``
of the installed TRL (sft, dpo, kto, reward, grpo with a reward model and a reference (beta > 0), rloo,
distillation) and, with ``--trl-src``, ``examples/scripts/{gkd,online_dpo}.py`` of that checkout (the installed
package does not ship them). Nothing of TRL lives in this repository. Each case runs twice: "upstream" (the
script as written) and "ours" (``deepspeed.initialize`` replaced by ``deepspeed_multi.initialize`` in every
process, tools/drop_in/sitecustomize.py).

The inputs are made once per --out: tiny Llama models from configs (a tied-embedding policy, a teacher, a
sequence-classification reward model) with random weights, a word-level tokenizer over a local vocabulary with a
chat template (a Llama config, because Transformers 5 loads a Qwen2 directory's tokenizer as Qwen2's BPE, which
reads a word-level vocabulary as no tokens at all), and 32-row jsonl datasets in each script's format. Each run: 4 optimizer steps, micro-batch 2,
gradient accumulation 2 (1 at ZeRO-1, whose yaml sets it), a checkpoint at step 4.

Compared per case, upstream vs ours (bit-identical is the target): every value of ``trainer_state.json``'s
log history but the run's wall-clock ones, the model the checkpoint saved (safetensors, ``torch.equal``), and
DeepSpeed's model and optimizer states in it (fp32 masters, Adam moments); on ours every engine built is
deepspeed_multi's and every rank built its own through the swap. A case that fails on both sides is reported as
such, with both errors, and does not fail the run; one that fails on ours only, or differs, does.

Writes <out>/results.json and <out>/summary.md, and per run <out>/runs/<case>/<side>/ (output.log,
drop_in.log, the script's output directory).
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402  (tools/peer_programs/common.py)

sys.path.pop(0)

NPROC = 2
STEPS = 4
GAS = 2
ROWS = 32
WORDS = [f"w{i}" for i in range(3, 64)]
# Script -> (where it lives: "package" (trl/scripts) or "src" (a checkout's examples/scripts), dataset, arguments).
SCRIPTS = {
    "sft": ("package", "text", ["--max_length", "32"]),
    "dpo": ("package", "pairs", ["--max_length", "32"]),
    "kto": ("package", "kto", ["--max_length", "32"]),
    "reward": ("package", "pairs_implicit", ["--max_length", "32"]),
    "grpo": ("package", "prompts", ["--reward_model_name_or_path", "{reward}", "--beta", "0.1",
                                    "--num_generations", "2", "--max_completion_length", "4"]),
    "rloo": ("package", "prompts", ["--reward_model_name_or_path", "{reward}", "--beta", "0.1",
                                    "--num_generations", "2", "--max_completion_length", "4"]),
    "distillation": ("package", "prompts", ["--teacher_model_name_or_path", "{teacher}",
                                            "--max_completion_length", "4"]),
    "gkd": ("src", "messages", ["--teacher_model_name_or_path", "{teacher}", "--max_new_tokens", "4",
                                "--max_length", "32"]),
    "online_dpo": ("src", "prompts", ["--reward_model_path", "{reward}", "--max_new_tokens", "4"]),
}
STAGES = (1, 2, 3)
WALL_CLOCK = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "step_time")


# ----------------------------------------------------------------------------------------------
# Inputs, made once per --out
# ----------------------------------------------------------------------------------------------

def prepare(assets):
    """Tiny Llama policy (tied), teacher and reward model with one tokenizer; datasets as <assets>/data/<name>/."""
    done = os.path.join(assets, "done")
    paths = {k: os.path.join(assets, k) for k in ("policy", "teacher", "reward")}
    if os.path.exists(done):
        return paths
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    chat = ("{% for m in messages %}{{ m['content'] + ' ' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '' }}{% endif %}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        chat_template=chat)

    def config(**kw):
        return LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)

    for seed, name, build in ((0, "policy", lambda: AutoModelForCausalLM.from_config(config(tie_word_embeddings=True))),
                              (1, "teacher", lambda: AutoModelForCausalLM.from_config(config())),
                              (2, "reward", lambda: AutoModelForSequenceClassification.from_config(
                                  config(num_labels=1)))):
        torch.manual_seed(seed)
        build().save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    probe = AutoTokenizer.from_pretrained(paths["policy"])("w3 w4")["input_ids"]
    assert probe == [3, 4], f"the scripts' AutoTokenizer reads the saved tokenizer as {probe}, not [3, 4]"

    g = torch.Generator().manual_seed(3)

    def words(n):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))

    def length():
        return int(torch.randint(3, 8, (1,), generator=g))

    rows = {"text": [], "pairs": [], "pairs_implicit": [], "kto": [], "prompts": [], "messages": []}
    for i in range(ROWS):
        prompt, chosen, rejected = words(length()), words(length()), words(length())
        rows["text"].append({"text": f"{prompt} {chosen}"})
        rows["pairs"].append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        rows["pairs_implicit"].append({"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"})
        rows["kto"].append({"prompt": prompt, "completion": chosen if i % 2 else rejected, "label": bool(i % 2)})
        rows["prompts"].append({"prompt": prompt})
        rows["messages"].append({"messages": [{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": chosen}]})
    for name, data in rows.items():
        folder = os.path.join(assets, "data", name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "train.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)
    open(done, "w").close()
    return paths


def launcher_config(stage, out):
    """TRL's shipped zero<stage>.yaml with num_processes 2 (nothing else changed); returns (its path, the gradient
    accumulation the scripts get: the yaml's own where it names one, as zero1.yaml does, else GAS)."""
    import trl
    import yaml
    with open(os.path.join(os.path.dirname(trl.__file__), "accelerate_configs", f"zero{stage}.yaml")) as f:
        config = yaml.safe_load(f)
    config["num_processes"] = NPROC
    path = os.path.join(out, "configs", f"zero{stage}.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path, config["deepspeed_config"].get("gradient_accumulation_steps", GAS)


def script_path(script, trl_src):
    import trl
    where = SCRIPTS[script][0]
    if where == "package":
        return os.path.join(os.path.dirname(trl.__file__), "scripts", f"{script}.py")
    return os.path.join(trl_src, "examples", "scripts", f"{script}.py") if trl_src else None


def script_args(script, paths, assets, output_dir, gas):
    _, data, extra = SCRIPTS[script]
    model = paths["policy"]
    args = ["--model_name_or_path", model, "--dataset_name", os.path.join(assets, "data", data),
            "--output_dir", output_dir, "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", str(gas), "--learning_rate", "1e-3", "--logging_steps", "1",
            "--save_strategy", "steps", "--save_steps", str(STEPS), "--report_to", "none", "--use_cpu", "True",
            "--seed", "0", "--data_seed", "0"]
    return args + [a.format(**paths) for a in extra]


# ----------------------------------------------------------------------------------------------
# One run, and what it left
# ----------------------------------------------------------------------------------------------

def run_one(script, stage, side, ctx):
    name = f"{script}-z{stage}"
    run_dir = os.path.join(ctx.out, "runs", name, side)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    swap_log = os.path.join(run_dir, "drop_in.log")
    env = common.side_env(side, swap_log)
    config, gas = ctx.configs[stage]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port", "0",
           script_path(script, ctx.trl_src),
           *script_args(script, ctx.paths, ctx.assets, os.path.join(run_dir, "output"), gas)]
    start = time.time()
    log = os.path.join(run_dir, "output.log")
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=run_dir, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=ctx.timeout,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.time() - start
    result = {"case": name, "side": side, "rc": rc, "seconds": round(seconds, 1), "dir": run_dir,
              "swap_problems": common.swap_problems(swap_log, side, NPROC), "engines": common.engine_counts(swap_log)}
    if rc != 0:
        result["error"] = common.error_tail(log)
    status = "ok" if rc == 0 else ("TIMEOUT" if rc is None else f"rc {rc}")
    print(f"  {name:<18} {side:<9} {status:<8} {seconds:6.1f} s", flush=True)
    return result


def _tensors(obj, prefix=""):
    """``{path: tensor}`` of every tensor inside a nested checkpoint object."""
    import torch
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    found = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}"))
    return found


def outputs(run):
    """What one finished run left in its last checkpoint: (log history, saved model, DeepSpeed's states)."""
    import torch
    from safetensors.torch import load_file
    ckpt = os.path.join(run["dir"], "output", f"checkpoint-{STEPS}")
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        logs = [{k: v for k, v in h.items() if k not in WALL_CLOCK} for h in json.load(f)["log_history"]]
    saved = {}
    for path in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        saved.update(load_file(path))
    states = {}
    for path in sorted(glob.glob(os.path.join(ckpt, f"global_step{STEPS}", "*.pt"))):
        states.update(_tensors(torch.load(path, map_location="cpu", weights_only=False), os.path.basename(path)))
    return logs, saved, states


def compare(a, b):
    logs_a, saved_a, states_a = outputs(a)
    logs_b, saved_b, states_b = outputs(b)
    if not logs_a or not (saved_a or states_a):
        raise RuntimeError(f"{a['dir']} left nothing to compare")
    out = {"steps": sum(1 for h in logs_a if "loss" in h), "logs": common.value_differences(logs_a, logs_b),
           "saved": common.tensor_differences(saved_a, saved_b), "states": common.tensor_differences(states_a, states_b),
           "state_tensors": len(states_a)}
    out["identical"] = not (out["logs"] or out["saved"] or out["states"])
    return out


def verdict(upstream, ours):
    """(status, text) for one case: "identical", "differs", "fails on both sides", "fails on ours", ..."""
    if upstream["rc"] != 0 and ours["rc"] != 0:
        return "fails on both sides", f"upstream: {_last_error(upstream)} / ours: {_last_error(ours)}"
    if ours["rc"] != 0:
        return "fails on ours", _last_error(ours)
    if upstream["rc"] != 0:
        return "fails on upstream only", _last_error(upstream)
    if ours["swap_problems"] or upstream["swap_problems"]:
        return "swap problem", f"ours: {ours['swap_problems']}, upstream: {upstream['swap_problems']}"
    d = compare(upstream, ours)
    if d["identical"]:
        return "identical", (f"{d['steps']} logged steps, saved model and {d['state_tensors']} DeepSpeed state "
                             f"tensors bit-identical; engines {ours['engines']}")
    return "differs", f"logs {d['logs'][:3]}, saved {d['saved'][:3]}, states {d['states'][:3]}"


def _last_error(run):
    lines = [line for line in (run.get("error") or "").splitlines() if "Error" in line or "error" in line]
    return lines[-1].strip() if lines else f"rc {run['rc']}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trl-src", help="a TRL checkout, for examples/scripts/{gkd,online_dpo}.py")
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    ctx = argparse.Namespace(out=os.path.abspath(args.out), timeout=args.timeout,
                             trl_src=os.path.abspath(args.trl_src) if args.trl_src else None)
    ctx.assets = os.path.join(ctx.out, "assets")
    ctx.paths = prepare(ctx.assets)
    stages = [int(s) for s in args.stages.split(",")]
    ctx.configs = {s: launcher_config(s, ctx.out) for s in stages}
    results, failed = [], False
    for script in args.scripts.split(","):
        if script_path(script, ctx.trl_src) is None:
            results.append({"case": script, "status": "not run", "text": "needs --trl-src (examples/scripts)"})
            failed = True
            continue
        for stage in stages:
            upstream, ours = (run_one(script, stage, side, ctx) for side in common.SIDES)
            status, text = verdict(upstream, ours)
            failed |= status not in ("identical", "fails on both sides")
            results.append({"case": f"{script}-z{stage}", "status": status, "text": text,
                            "seconds": [upstream["seconds"], ours["seconds"]]})
            print(f"    -> {status}: {text}", flush=True)
    with open(os.path.join(ctx.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["# TRL's scripts under accelerate launch: upstream vs deepspeed_multi", "",
             "| case | result | detail |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['status']} | {r['text'].replace('|', '/')} |" for r in results]
    with open(os.path.join(ctx.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
