"""OpenRLHF's SFT, reward-model and DPO trainers, upstream and with deepspeed_multi, compared bit for bit.

    python tools/peer_programs/openrlhf/run.py --out <results dir> --packages <folder with openrlhf>
        [--trainers sft,rm,dpo] [--stages 1,2,3] [--dtypes bf16,fp32] [--options overlap,...] [--case GLOB ...]
        [--no-determinism] [--no-one-backward] [--timeout S]

What runs: ``openrlhf.cli.train_sft``, ``openrlhf.cli.train_rm`` and ``openrlhf.cli.train_dpo``
(policy trained, reference frozen) of the OpenRLHF found at ``--packages`` (a ``pip install
--target`` folder holding ``openrlhf==0.11.0``, or an OpenRLHF checkout; nothing of OpenRLHF lives in
this repository), at ZeRO stages 1, 2 and 3, each under ``torchrun --standalone --nproc_per_node=2``
twice: "upstream" (the program as written) and "ours" (``deepspeed.initialize`` replaced by
``deepspeed_multi.initialize`` in every process, tools/drop_in/sitecustomize.py). Every rank starts
through launch.py beside this file, which applies the CPU shims both sides need, records what the
trainer logs, and then runs the CLI module unchanged with ``runpy``.

The inputs are made once per --out: a tiny Llama with random weights (save_pretrained), a word-level
tokenizer over a local vocabulary, and 32-example jsonl datasets (SFT prompt/response, RM and DPO
prompt/chosen/rejected). Each run is 4 optimizer steps of 2 micro-batches per rank (global batch 8,
micro-batch 2, 2 ranks: gradient accumulation 2), AdamW at lr 1e-3 (large enough for the steps to
move the weights visibly), bf16 (OpenRLHF's default ``--ds.param_dtype``) and, with --dtypes fp32,
a float32 variant (launch.py --fp32; OpenRLHF itself only offers bf16/fp16). --options adds cases
with OpenRLHF flags that change the DeepSpeed config it builds or the graph the engines' hooks see
(OPTIONS below: overlap_comm, Adam offload, activation checkpointing, ZeRO++ hpZ, fp32 gradient
accumulation). train_rm also gets an 8-pair --eval.dataset: it evaluates at the end of the epoch and
saves the reward mean/std in config.json (compared too).

What is compared per case, upstream vs ours (bit-identical is the target):
  * the dict the trainer passes to its log call at each optimizer step on rank 0 (loss, loss_mean,
    grad_norm, lr; for RM/DPO also acc, acc_mean, chosen_reward, reject_reward);
  * the trained engine's fp32 master weights just before the final save;
  * the model OpenRLHF saves at the end (--ckpt.output_dir, safetensors), with ``torch.equal``;
  * on ours, ``common.swap_problems``: every engine is deepspeed_multi's and both ranks built theirs
    through the swap (upstream: both ranks built engines and no process missed the hook).
Also: one case's upstream side (the first selected, or --determinism-case) runs twice and must repeat itself exactly (the
comparison means nothing otherwise), and the one-backward DPO variant (launch.py --one-backward:
the trainer's ``strategy.backward(loss, model, optimizer)`` becomes ``loss.backward()``) runs on ours
at each selected stage and is compared with ours unchanged.

Writes <out>/results.json and <out>/summary.md, and per run <out>/runs/<case>/<side>/ (output.log,
drop_in.log, logs.jsonl, master_fp32.pt, saved/). Exit status 1 when any comparison differs or a run
fails on ours only.
"""
import argparse
import fnmatch
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

LAUNCH = os.path.join(HERE, "launch.py")
TRAINERS = {"sft": "openrlhf.cli.train_sft", "rm": "openrlhf.cli.train_rm", "dpo": "openrlhf.cli.train_dpo"}
STAGES = (1, 2, 3)
DTYPES = ("bf16", "fp32")
# --options: OpenRLHF flags that change the DeepSpeed config it builds or the autograd graph the
# engines' hooks see; each named one adds a case per trainer, stage and dtype ("dpo-z1-bf16-overlap").
OPTIONS = {
    "overlap": ["--ds.overlap_comm"],  # overlap_comm + contiguous_gradients in zero_optimization
    "offload": ["--ds.adam_offload"],  # offload_optimizer to CPU: DeepSpeedCPUAdam
    "gc": ["--model.gradient_checkpointing_enable"],  # non-reentrant activation checkpointing
    "gcre": ["--model.gradient_checkpointing_enable", "--model.gradient_checkpointing_reentrant"],
    "zpg2": ["--ds.zpg", "2"],  # zero_hpz_partition_size 2 (ZeRO++ hierarchical partitioning)
    "accfp32": ["--ds.grad_accum_dtype", "fp32"],  # data_types.grad_accum_dtype
}
NPROC = 2
EXAMPLES = 32  # with a global batch of 8: 4 optimizer steps
# The same prompt template for all three trainers (SFT's default), so that prompt and response
# join with a space and every word is in the vocabulary.
TEMPLATE = "User: {}\nAssistant: "
VOCAB_WORDS = 61  # w3 .. w63


# ----------------------------------------------------------------------------------------------
# Inputs, made once per --out
# ----------------------------------------------------------------------------------------------

def prepare(assets):
    """Tiny Llama + tokenizer in <assets>/model, datasets in <assets>/{sft,pairs}.jsonl."""
    model_dir = os.path.join(assets, "model")
    done = os.path.join(assets, "done")
    if os.path.exists(done):
        return model_dir
    os.makedirs(assets, exist_ok=True)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.manual_seed(0)
    words = [f"w{i}" for i in range(3, 3 + VOCAB_WORDS)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    vocab.update({"User:": len(vocab), "Assistant:": len(vocab) + 1})
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # The trainers read text through --data.input_template, not a chat template; one is saved anyway
    # so that --data.apply_chat_template would work with this tokenizer too.
    chat = ("{% for m in messages %}{{ ('User: ' if m['role'] == 'user' else 'Assistant: ') + m['content'] + ' ' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            chat_template=chat).save_pretrained(model_dir)

    g = torch.Generator().manual_seed(1)

    def counting(start, n):
        return " ".join(words[(start + i) % VOCAB_WORDS] for i in range(n))

    def rand(n):
        return " ".join(words[int(i)] for i in torch.randint(0, VOCAB_WORDS, (n,), generator=g))

    sft, pairs = [], []
    for _ in range(EXAMPLES):
        start = int(torch.randint(0, VOCAB_WORDS, (1,), generator=g))
        n_prompt, n_resp = (int(x) for x in torch.randint(3, 9, (2,), generator=g))  # uneven lengths: padding
        prompt = counting(start, n_prompt)
        chosen = counting(start + n_prompt, n_resp)
        sft.append({"input": prompt, "output": chosen})
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rand(n_resp)})
    # train_rm evaluates at the end of the epoch (reward mean/std, saved in config.json) on
    # --eval.dataset, else on 1% of the training set: 0 rows here, which its RewardDataset cannot map.
    pairs_eval = []
    for _ in range(8):
        start = int(torch.randint(0, VOCAB_WORDS, (1,), generator=g))
        prompt, chosen = counting(start, 4), counting(start + 4, 4)
        pairs_eval.append({"prompt": prompt, "chosen": chosen, "rejected": rand(4)})
    for name, rows in (("sft", sft), ("pairs", pairs), ("pairs_eval", pairs_eval)):
        with open(os.path.join(assets, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    open(done, "w").close()
    return model_dir


def cli_args(trainer, stage, option, assets, model_dir, run_dir):
    """The CLI arguments of one run (dtype is launch.py's business: --ds.param_dtype stays bf16)."""
    args = ["--model.model_name_or_path", model_dir,
            "--ckpt.output_dir", os.path.join(run_dir, "saved"), "--ckpt.path", os.path.join(run_dir, "ckpt"),
            "--train.micro_batch_size", "2", "--train.batch_size", "8", "--train.max_epochs", "1",
            "--train.seed", "42", "--ds.zero_stage", str(stage), "--ds.param_dtype", "bf16",
            "--ds.attn_implementation", "eager",  # no flash-attn on CPU
            "--adam.lr", "1e-3", "--lr_warmup_ratio", "0",  # a warm-up step would update at lr 0
            "--data.max_len", "64", "--data.input_template", TEMPLATE,
            "--logger.wandb.run_name", "peer"]  # its default has the time in it
    if trainer == "sft":
        args += ["--data.dataset", os.path.join(assets, "sft.jsonl"),
                 "--data.input_key", "input", "--data.output_key", "output"]
    else:
        args += ["--data.dataset", os.path.join(assets, "pairs.jsonl"), "--data.prompt_key", "prompt",
                 "--data.chosen_key", "chosen", "--data.rejected_key", "rejected"]
    if trainer == "rm":
        args += ["--eval.dataset", os.path.join(assets, "pairs_eval.jsonl")]
    if trainer == "dpo":
        args += ["--ref.model_name_or_path", model_dir, "--model.beta", "0.1"]
    return args + OPTIONS.get(option, [])


# ----------------------------------------------------------------------------------------------
# One run, and what it left
# ----------------------------------------------------------------------------------------------

def run_one(case, side, variant, ctx):
    trainer, stage, dtype, option = case
    name = case_name(case)
    run_dir = os.path.join(ctx.out, "runs", name, side + (f"-{variant}" if variant else ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    swap_log = os.path.join(run_dir, "drop_in.log")
    env = common.side_env(side, swap_log, python_path=[p for p in [ctx.packages] if p])
    launch = [LAUNCH, "--module", TRAINERS[trainer], "--record", run_dir]
    if dtype == "fp32":
        launch.append("--fp32")
    if variant == "one-backward":
        launch.append("--one-backward")
    launch += ["--"] + cli_args(trainer, stage, option, ctx.assets, ctx.model_dir, run_dir)
    rc, seconds = common.torchrun(launch, NPROC, env, run_dir, os.path.join(run_dir, "output.log"), ctx.timeout)
    result = {"case": name, "side": side, "variant": variant, "rc": rc, "seconds": round(seconds, 1),
              "dir": os.path.relpath(run_dir, ctx.out)}
    result["swap_problems"] = common.swap_problems(swap_log, "ours" if side == "ours" else "upstream", NPROC)
    result["engines"] = common.engine_counts(swap_log)
    result["shims"] = shim_lines(os.path.join(run_dir, "output.log"))
    if rc != 0:
        result["error"] = common.error_tail(os.path.join(run_dir, "output.log"))
    status = "ok" if rc == 0 else ("TIMEOUT" if rc is None else f"rc {rc}")
    print(f"  {name:<14} {side + (' ' + variant if variant else ''):<22} {status:<8} {seconds:6.1f} s", flush=True)
    return result


def shim_lines(log):
    """The distinct shim lines a run printed (each rank prints its own)."""
    seen = []
    with open(log, errors="replace") as f:
        for line in f:
            # Two ranks' lines can land on one line of the shared output.
            for piece in line.split("[openrlhf-shim]")[1:]:
                s = piece.strip()
                if s and s not in seen:
                    seen.append(s)
    return seen


def outputs(run):
    """What one finished run left: (logged rows, master weights, saved model weights)."""
    import torch
    from safetensors.torch import load_file
    d = run["abs_dir"]
    with open(os.path.join(d, "logs.jsonl")) as f:
        logs = [json.loads(line) for line in f]
    master = torch.load(os.path.join(d, "master_fp32.pt"))
    saved = {}
    for path in sorted(glob.glob(os.path.join(d, "saved", "*.safetensors"))):
        saved.update(load_file(path))
    # train_rm's evaluation writes the reward mean/std into the saved config.json: compared as one
    # more logged record.
    with open(os.path.join(d, "saved", "config.json")) as f:
        config = json.load(f)
    if "mean" in config:
        logs = logs + [{"saved config.json": True, "mean": config["mean"], "std": config["std"]}]
    return logs, master, saved


def compare(a, b):
    """Upstream-like run ``a`` vs ``b``: a dict of what differs (empty lists when identical)."""
    logs_a, master_a, saved_a = outputs(a)
    logs_b, master_b, saved_b = outputs(b)
    if not logs_a or not master_a or not saved_a:
        raise RuntimeError(f"{a['dir']} recorded nothing to compare")
    out = {"steps": sum(1 for r in logs_a if "global_step" in r), "logs": common.value_differences(logs_a, logs_b),
           "master": common.tensor_differences(master_a, master_b),
           "saved": common.tensor_differences(saved_a, saved_b)}
    out["identical"] = not (out["logs"] or out["master"] or out["saved"])
    return out


def describe_diff(d):
    """One line: where the first difference is and how large the largest is."""
    if d["identical"]:
        return f"identical ({d['steps']} steps: logs, fp32 master, saved model)"
    parts = []
    if d["logs"]:
        step, key, x, y = d["logs"][0]
        rel = [abs(u - v) for _, _, u, v in d["logs"] if isinstance(u, (int, float)) and isinstance(v, (int, float))]
        parts.append(f"logs differ from step record {step} ({key}: {x!r} vs {y!r}); largest |diff| "
                     f"{max(rel) if rel else 'n/a'} over {len(d['logs'])} values")
    for what in ("master", "saved"):
        if d[what]:
            parts.append(f"{what}: {len(d[what])} tensors differ, e.g. {d[what][0][0]} {d[what][0][1]}; "
                         f"largest {largest(d[what])}")
    return "differs: " + "; ".join(parts)


def largest(diffs):
    vals = []
    for _, what in diffs:
        if what.startswith("max |diff| "):
            vals.append(float(what.split()[-1]))
    return f"{max(vals):.3e}" if vals else "n/a"


# ----------------------------------------------------------------------------------------------

def case_name(case):
    trainer, stage, dtype, option = case
    return f"{trainer}-z{stage}-{dtype}" + (f"-{option}" if option else "")


def openrlhf_where(packages):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in [packages, env.get("PYTHONPATH")] if p])
    code = ("import importlib.util, importlib.metadata as m, os\n"
            "s = importlib.util.find_spec('openrlhf')\n"
            "print(os.path.dirname(s.origin))\n"
            "try: print(m.version('openrlhf'))\n"
            "except Exception: print(open(os.path.join(os.path.dirname(os.path.dirname(s.origin)), 'version.txt')).read().strip())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"openrlhf is not importable with --packages {packages!r}:\n{out.stderr[-2000:]}")
    where, version = out.stdout.split()[:2]
    return where, version


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True, help="results folder (inputs are made once in <out>/assets)")
    ap.add_argument("--packages", default=None,
                    help="folder put on PYTHONPATH for the runs: a `pip install --target` folder holding "
                         "openrlhf==0.11.0 (and torchdata, sympy, pylatexenc, pillow), or an OpenRLHF checkout")
    ap.add_argument("--trainers", default="sft,rm,dpo")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--options", default="", help=f"comma-separated, each adds its cases: {', '.join(OPTIONS)}")
    ap.add_argument("--case", nargs="*", default=None, help="only cases matching these globs, e.g. 'dpo-z3-*'")
    ap.add_argument("--no-determinism", action="store_true", help="skip the repeated upstream run")
    ap.add_argument("--determinism-case", default=None,
                    help="the case whose upstream side runs twice (default: the first selected)")
    ap.add_argument("--no-one-backward", action="store_true", help="skip the one-backward DPO variant")
    ap.add_argument("--one-backward-cases", nargs="*", default=["dpo-*"],
                    help="DPO cases that also run the one-backward variant (default: all selected)")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per run")
    args = ap.parse_args()

    ctx = argparse.Namespace(out=os.path.abspath(args.out), timeout=args.timeout,
                             packages=os.path.abspath(args.packages) if args.packages else None)
    os.makedirs(ctx.out, exist_ok=True)
    where, version = openrlhf_where(ctx.packages)
    print(f"openrlhf {version} from {where}", flush=True)
    ctx.assets = os.path.join(ctx.out, "assets")
    ctx.model_dir = prepare(ctx.assets)

    options = [None] + [o for o in (args.options or "").split(",") if o]
    cases = [(t, s, d, o) for t in args.trainers.split(",") for s in map(int, args.stages.split(","))
             for d in args.dtypes.split(",") for o in options]
    for t, s, d, o in cases:
        if t not in TRAINERS or s not in STAGES or d not in DTYPES or (o and o not in OPTIONS):
            raise SystemExit(f"unknown case {case_name((t, s, d, o))}")
    if args.case:
        cases = [c for c in cases if any(fnmatch.fnmatch(case_name(c), g) for g in args.case)]
    if not cases:
        raise SystemExit("no case selected")

    repeat = args.determinism_case or case_name(cases[0])
    results = {"openrlhf": {"version": version, "path": where}, "cases": [], "determinism": None,
               "one_backward": []}
    failed = False
    for case in cases:
        name = case_name(case)
        runs = {}
        for side in common.SIDES:
            runs[side] = run_one(case, side, None, ctx)
            runs[side]["abs_dir"] = os.path.join(ctx.out, runs[side]["dir"])
        entry = {"case": name, "runs": {k: strip(v) for k, v in runs.items()}}
        up, ours = runs["upstream"]["rc"] == 0, runs["ours"]["rc"] == 0
        if up and ours:
            entry["diff"] = compare(runs["upstream"], runs["ours"])
            entry["verdict"] = describe_diff(entry["diff"])
            failed |= not entry["diff"]["identical"]
        elif not up and not ours:
            entry["verdict"] = "both fail"
        elif up:
            entry["verdict"] = "fails on ours"
            failed = True
        else:
            entry["verdict"] = "fails upstream only"
        problems = runs["ours"]["swap_problems"] + [f"upstream: {p}" for p in runs["upstream"]["swap_problems"]]
        if problems and (up and ours):
            entry["verdict"] += "; swap: " + "; ".join(problems)
            failed = True
        print(f"  => {name}: {entry['verdict']}", flush=True)
        results["cases"].append(entry)

        if name == repeat and not args.no_determinism and up:
            again = run_one(case, "upstream", "repeat", ctx)
            again["abs_dir"] = os.path.join(ctx.out, again["dir"])
            det = {"case": name, "run": strip(again)}
            if again["rc"] == 0:
                det["diff"] = compare(runs["upstream"], again)
                det["verdict"] = describe_diff(det["diff"])
                failed |= not det["diff"]["identical"]
            else:
                det["verdict"] = "the repeat failed"
                failed = True
            print(f"  => determinism ({name}, upstream twice): {det['verdict']}", flush=True)
            results["determinism"] = det

        if (case[0] == "dpo" and not args.no_one_backward and ours
                and any(fnmatch.fnmatch(name, g) for g in args.one_backward_cases)):
            ob = run_one(case, "ours", "one-backward", ctx)
            ob["abs_dir"] = os.path.join(ctx.out, ob["dir"])
            item = {"case": name, "run": strip(ob)}
            if ob["rc"] == 0:
                item["diff"] = compare(runs["ours"], ob)
                item["verdict"] = describe_diff(item["diff"])
                if not any("--one-backward" in s for s in ob["shims"]):
                    item["verdict"] += " (but the one-backward patch never acted)"
                    failed = True
            else:
                item["verdict"] = "fails"
            print(f"  => one-backward ({name}, ours vs ours): {item['verdict']}", flush=True)
            results["one_backward"].append(item)

        write(ctx.out, results)  # after each case: a long run can be read while it goes
    write(ctx.out, results)
    print(f"wrote {os.path.join(ctx.out, 'summary.md')}", flush=True)
    return 1 if failed else 0


def strip(run):
    return {k: v for k, v in run.items() if k != "abs_dir"}


def write(out, results):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    lines = [f"# OpenRLHF {results['openrlhf']['version']} upstream vs ours", "",
             "| case | upstream s | ours s | result |", "| --- | --- | --- | --- |"]
    for e in results["cases"]:
        r = e["runs"]
        lines.append(f"| {e['case']} | {r['upstream']['seconds']} | {r['ours']['seconds']} | {e['verdict']} |")
    if results["determinism"]:
        d = results["determinism"]
        lines += ["", f"Determinism ({d['case']}, upstream twice, {d['run']['seconds']} s): {d['verdict']}"]
    for ob in results["one_backward"]:
        lines += ["", f"One-backward ({ob['case']}, ours, {ob['run']['seconds']} s) vs ours unchanged: {ob['verdict']}"]
    shims = {}
    for e in results["cases"]:
        for side, r in e["runs"].items():
            for s in r["shims"]:
                shims.setdefault(s, set()).add(side)
    if shims:
        lines += ["", "Shims that acted:", ""]
        lines += [f"- {s} ({', '.join(sorted(sides))})" for s, sides in shims.items()]
    errors = [(e["case"], side, r["error"]) for e in results["cases"] for side, r in e["runs"].items() if r.get("error")]
    for case, side, err in errors:
        lines += ["", f"## {case} {side} failed", "", "```", err, "```"]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
