"""DeepSpeed-Chat's step 3 (PPO) run unchanged upstream and with deepspeed_multi.initialize, compared.

    python tools/peer_programs/deepspeed_chat/run.py --src <DeepSpeed-Chat dir> --out <results dir>
        [--pairs A,C ...] [--ema on off] [--gas 1 2] [--offload off on]
        [--fix-upstream auto|on|off] [--one-backward [A,C ...]] [--hybrid] [--check-determinism]
        [--sides upstream|ours] [--no-shim NAME] [--package worktree|<commit>] [--timeout S] [--list]

<DeepSpeed-Chat dir> is applications/DeepSpeed-Chat of a DeepSpeedExamples checkout; nothing of it
lives in this repository. What it runs, once per case and side:

    torchrun --standalone --nproc_per_node=2 launch.py --main <src>/training/step3_rlhf_finetuning/main.py -- ...

main.py is unchanged; launch.py (beside this file) applies the environment shims both sides need
(each prints a line when it acts: see its docstring) and then runs main.py with runpy. The sides:
"upstream" is the program as written; "ours" has ``deepspeed.initialize`` replaced by
``deepspeed_multi.initialize`` in every process (tools/drop_in/sitecustomize.py, through
common.side_env). Each run trains 8 PPO updates: a tiny random-weight Llama actor (with its
reference and, with --enable_ema, its EMA copy) and a tiny Llama critic/reward model stored the way
DeepSpeed-Chat's create_critic_model loads one from a path, bf16, 2 ranks on CPU, a prompt set of
counting words given to DeepSpeed-Chat's data_utils as its "local/jsonfile" dataset. All of it is
made once under <out>/prepared (nothing is downloaded), and main.py reads the dataset from a shadow
tree there (links to <src>'s dschat/ and training/ beside a data/ folder), so <src> is not written.

What is compared per case, upstream vs ours: every actor loss, critic loss, reward and EMA reward
main.py prints (rank 0's lines, per step), and the final actor, critic and EMA weights main.py saves
to its --output_dir, with torch.equal (common.tensor_differences): bit-identical is the target. On
both sides common.swap_problems checks the swap log (ours: every engine deepspeed_multi's, both
ranks built engines through the swap), and the engine count is checked: actor, reference, critic,
reward (and EMA) on each rank, 10 on 2 ranks with EMA.

Cases: the actor/critic ZeRO stage pair (0-3 each) and the axes EMA on/off, gradient accumulation
1/2 and optimizer offload off/on (--offload: DeepSpeedCPUAdam, ZeRO offload_optimizer to the CPU).
Without filters DEFAULT_SELECTION runs (every pair at ema on, gas 2, offload off, plus each other
axis flipped at a few pairs); any of --pairs/--ema/--gas/--offload selects their cross product
(an axis not given keeps its default value).

Known upstream defect, and --fix-upstream: DeepSpeed counts ZeRO-3's micro-steps at the start of
DeepSpeedEngine.forward (optimizer.clear_backward_seen_flag); DeepSpeed-Chat's critic calls
engine.forward_value, the module's method, around it, so with a ZeRO-3 critic and gradient
accumulation upstream's second micro-batch gradient overwrites the first. "auto" (the default)
runs upstream with that count made at the start of engine.backward instead (launch.py
--fix-zero3-micro-step) exactly for those cases, and the report says "upstream with its ZeRO-3
micro-step count fixed"; "off" shows the defect, "on" applies it everywhere.

--one-backward also runs ours with train_rlhf's two engine.backward calls replaced by one
``(actor_loss + critic_loss).backward()`` and compares it with ours unchanged (at every selected
case, or with pairs after it at those pairs only). --hybrid adds
--enable_hybrid_engine (DeepSpeed's hybrid engine has no CPU op: both sides are expected to fail).
--check-determinism runs upstream a second time and compares it with the first.

--sides runs one side only (no comparison); --no-shim NAME leaves one of launch.py's shims out, to see
that it is needed. --package HEAD (or any commit) runs ours on that commit's deepspeed_multi/ (git
archive into <out>/package/) instead of the work tree, so edits in progress do not reach a run.

Results: <out>/cases/<case>/<side>/ (log, swap log, saved weights), <out>/results.json (one entry per
case, merged across invocations) and <out>/report.md (the table of every case in results.json).
Exit status 1 when ours does not give upstream's bits where upstream runs (see not_as_expected).

Time: one run takes under a minute per side on 2 CPU cores (start-up, importing DeepSpeed and
Transformers, is a good part of it; ZeRO-3 runs are the slowest), so DEFAULT_SELECTION (31 cases) takes
about 45 minutes; --one-backward adds a third run per case.
"""
import argparse
import itertools
import json
import os
import re
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402  (tools/peer_programs/common.py)

sys.path.pop(0)

LAUNCH = os.path.join(HERE, "launch.py")
PYTHON = os.path.join(common.REPO, ".venv", "bin", "python")
if not os.path.exists(PYTHON):
    PYTHON = sys.executable
STEPS = 8  # PPO updates per run: each generation step holds gas micro-batches, one update
TRAIN_BATCH = 2  # per device; the generation batch is TRAIN_BATCH * gas
PROMPTS = 2 * TRAIN_BATCH * 2 * STEPS  # 2 ranks, largest gas 2: 8 generation steps per rank
SEED = 1234
VOCAB = 64  # <pad> <s> </s> w3..w63; DeepSpeed-Chat makes eos (</s>) the pad token

# The default selection: every pair at ema on, gas 2, offload off; then each other axis flipped at
# five pairs: ZeRO-0 beside ZeRO-1, ZeRO-2 alone, and ZeRO-3 on the actor, on the critic (the
# micro-step defect's pair) and on both.
AXIS_PAIRS = [(0, 1), (2, 2), (2, 3), (3, 2), (3, 3)]
DEFAULT = dict(ema="on", gas=2, offload="off")
DEFAULT_SELECTION = (
    [dict(DEFAULT, pair=(a, c)) for a in range(4) for c in range(4)]
    + [dict(DEFAULT, pair=p, ema="off") for p in AXIS_PAIRS]
    + [dict(DEFAULT, pair=p, gas=1) for p in AXIS_PAIRS]
    + [dict(DEFAULT, pair=p, offload="on") for p in AXIS_PAIRS])

FIXED_UPSTREAM = "upstream with its ZeRO-3 micro-step count fixed"


def case_id(case):
    a, c = case["pair"]
    return f"a{a}c{c}-ema_{case['ema']}-gas{case['gas']}-offload_{case['offload']}" + ("-hybrid" if case.get(
        "hybrid") else "")


def upstream_known_wrong(case):
    """The cases where upstream's ZeRO-3 micro-step count misses DeepSpeed-Chat's forward_value."""
    return case["pair"][1] == 3 and case["gas"] > 1


# ------------------------------------------------------------------------------- prepared inputs
def prepare(out, src):
    """Once per --out: the tiny actor (HF dir with the tokenizer), the critic in create_critic_model's
    form (config.json + pytorch_model.bin of a RewardModel state dict), the prompt data and the
    shadow tree. Returns its paths."""
    root = os.path.join(out, "prepared")
    paths = dict(actor=os.path.join(root, "actor"), critic=os.path.join(root, "critic"),
                 chat=os.path.join(root, "deepspeed_chat"))
    paths["main"] = os.path.join(paths["chat"], "training", "step3_rlhf_finetuning", "main.py")
    # load_hf_tokenizer picks LlamaTokenizer (sentencepiece, which our local tokenizer is not) when
    # "llama" is anywhere in the model path.
    if "llama" in os.path.abspath(root).lower():
        raise SystemExit(f"--out must not contain 'llama' ({root}): DeepSpeed-Chat would then load LlamaTokenizer")
    stamp = os.path.join(root, "done")
    if not os.path.exists(stamp):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        _write_models(paths["actor"], paths["critic"])
        _write_shadow(paths["chat"], src)
        with open(stamp, "w") as f:
            f.write(os.path.abspath(src) + "\n")
    else:
        with open(stamp) as f:
            made_from = f.read().strip()
        if made_from != os.path.abspath(src):
            raise SystemExit(f"{root} was prepared from {made_from}; use another --out for {src}")
    return paths


def _tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built locally (as examples/trl/_common.py)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _llama_config():
    from transformers import LlamaConfig
    # intermediate 256: the MLP weights (16,384 elements) are above DeepSpeed-Chat's
    # stage3_param_persistence_threshold (1e4), so ZeRO-3 partitions them; attention and the
    # embeddings (4,096) stay persistent. Both kinds are exercised.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=2,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_dropout=0.0)


def _write_models(actor_dir, critic_dir):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(_llama_config())
    with torch.no_grad():
        # eos is DeepSpeed-Chat's pad: an answer whose 2nd token is eos is dropped, and a rank with
        # fewer micro-batches than the other hangs the run. A zero eos row (logit 0 among 63 random
        # ones) keeps greedy decoding off eos.
        actor.lm_head.weight[2].zero_()
    actor.save_pretrained(actor_dir)
    _tokenizer().save_pretrained(actor_dir)
    # The critic: DeepSpeed-Chat's RewardModel(AutoModel) state dict (rwtransformer.*, v_head.weight)
    # in pytorch_model.bin beside the base model's config.json, what create_critic_model loads.
    base = AutoModel.from_config(_llama_config())
    v_head = torch.nn.Linear(base.config.hidden_size, 1, bias=False)
    state = {f"rwtransformer.{k}": v for k, v in base.state_dict().items()}
    state["v_head.weight"] = v_head.weight.detach().clone()
    os.makedirs(critic_dir)
    base.config.save_pretrained(critic_dir)
    torch.save(state, os.path.join(critic_dir, "pytorch_model.bin"))


def _write_shadow(chat, src):
    """data_utils reads "local/jsonfile" from <DeepSpeed-Chat>/data, found from its own __file__:
    links to <src>'s dschat/ and training/ beside our data/ make that <out>/prepared/deepspeed_chat."""
    import random
    os.makedirs(os.path.join(chat, "data"))
    for name in ("dschat", "training"):
        os.symlink(os.path.join(os.path.abspath(src), name), os.path.join(chat, name))
    rng = random.Random(0)

    def words(n):
        start = rng.randrange(VOCAB - 3)
        return " ".join(f"w{3 + (start + i) % (VOCAB - 3)}" for i in range(n))

    for split, n in (("train", PROMPTS), ("eval", 8)):
        with open(os.path.join(chat, "data", f"{split}.json"), "w") as f:
            json.dump([{"prompt": words(rng.randint(3, 8)), "chosen": words(4), "rejected": words(4)}
                       for _ in range(n)], f)


# ---------------------------------------------------------------------------------------- one run
def main_args(case, paths, run_dir):
    a, c = case["pair"]
    args = ["--data_path", "local/jsonfile", "--data_split", "0,0,1",
            "--data_output_path", os.path.join(run_dir, "data_files"),
            "--actor_model_name_or_path", paths["actor"], "--critic_model_name_or_path", paths["critic"],
            "--num_padding_at_beginning", "0",
            "--per_device_training_batch_size", str(TRAIN_BATCH),
            "--per_device_generation_batch_size", str(TRAIN_BATCH * case["gas"]),
            "--gradient_accumulation_steps", str(case["gas"]),
            "--generation_batches", "1", "--ppo_epochs", "1", "--num_train_epochs", "1",
            "--max_prompt_seq_len", "8", "--max_answer_seq_len", "8",
            # a constant rate with no warm-up: DeepSpeed-Chat's default warms up over 100 steps from 0,
            # which in 8 updates would move bf16 weights too little to tell sides apart
            "--actor_learning_rate", "5e-4", "--critic_learning_rate", "1e-3",
            "--lr_scheduler_type", "constant", "--num_warmup_steps", "0",
            "--dtype", "bf16", "--seed", str(SEED),
            "--actor_zero_stage", str(a), "--critic_zero_stage", str(c),
            "--enable_test_mode", "--test_stop_step", str(STEPS),
            "--output_dir", os.path.join(run_dir, "output")]
    if case["ema"] == "on":
        args.append("--enable_ema")
    if case["offload"] == "on":
        args.append("--offload")
    if case.get("hybrid"):
        args.append("--enable_hybrid_engine")
    return args


def run_one(case, side, paths, out, variant, patches, timeout_s):
    """One side of one case under torchrun; returns what it printed and saved, parsed."""
    run_dir = os.path.join(out, "cases", case["key"], variant)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    log = os.path.join(run_dir, "engines.log")
    env = common.side_env(side, log, python_path=[paths["chat"], *paths["package_path"]])
    args = [LAUNCH, "--main", paths["main"], *patches, "--", *main_args(case, paths, run_dir)]
    print(f"  {variant}: running", flush=True)
    rc, seconds = common.torchrun(args, 2, env, cwd=run_dir, out_path=os.path.join(run_dir, "output.log"),
                                  timeout_s=timeout_s, python=PYTHON)
    with open(os.path.join(run_dir, "output.log"), errors="replace") as f:
        text = f.read()
    result = dict(variant=variant, side=side, rc=rc, seconds=round(seconds, 1), records=parse_records(text),
                  shims=sorted(set(re.findall(r"\[dschat-(?:shim|patch)\] rank \d+: ([\w-]+)", text))),
                  swap_problems=common.swap_problems(log, side, ranks=2), engines=common.engine_counts(log),
                  error=(f"timed out after {timeout_s}s" if rc is None else first_error(text)) if rc != 0 else None,
                  dir=run_dir)
    print(f"  {variant}: rc {rc} in {seconds:.0f}s, {len(result['records'])} steps printed"
          + (f", error: {result['error']}" if result["error"] else ""), flush=True)
    return result


STEP_LINE = re.compile(r"Epoch: (\d+) \| Step: (\d+) \| PPO Epoch: \d+ \| Actor Loss: (\S+) \| Critic Loss: (\S+)")
REWARD_LINE = re.compile(r"Average reward score: (\S+) \| EMA reward score: (\S+)")


def parse_records(text):
    """main.py's per-step lines (rank 0 prints them) -> [{step, actor_loss, critic_loss, reward, ema_reward}]."""
    records = []
    for line in text.splitlines():
        m = STEP_LINE.search(line)
        if m:
            records.append(dict(step=int(m.group(2)), actor_loss=float(m.group(3)), critic_loss=float(m.group(4))))
            continue
        m = REWARD_LINE.search(line)
        if m and records:
            records[-1].update(reward=float(m.group(1)), ema_reward=float(m.group(2)))
    return records


def first_error(text):
    """The first exception line of a failed run (a deepspeed_multi refusal, an assertion, ...); a bare
    AssertionError gets the source line of its assert."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", l).rstrip() for l in text.splitlines()]
    for i, line in enumerate(lines):
        if re.match(r"^(\w+\.)*\w*(Error|Exception)\b", line) and "ChildFailedError" not in line:
            if line.strip() == "AssertionError":
                source = [l.strip() for l in lines[max(0, i - 4):i] if l.strip() and not set(l.strip()) <= set("^~ ")]
                line += f" ({source[-1]})" if source else ""
            return line.strip()[:400]
    return (lines[-1].strip() if lines else "no output")[:400]


def saved_weights(run_dir):
    """The actor, critic and EMA state dicts main.py saved: {"actor/<name>": tensor, ...}."""
    import torch
    weights = {}
    for sub in ("actor", "critic", "actor_ema"):
        path = os.path.join(run_dir, "output", sub, "pytorch_model.bin")
        if os.path.exists(path):
            for k, v in torch.load(path, map_location="cpu", weights_only=True).items():
                weights[f"{sub}/{k}"] = v
    return weights


# ------------------------------------------------------------------------------------ comparison
def compare(a, b, case):
    """Two runs' results -> {"identical": bool, "values": [...], "weights": [...], "summary": str}."""
    values = common.value_differences(a["records"], b["records"])
    wa, wb = saved_weights(a["dir"]), saved_weights(b["dir"])
    weights = common.tensor_differences(wa, wb)
    problems = []
    if len(a["records"]) != STEPS or len(b["records"]) != STEPS:
        problems.append(f"steps printed {len(a['records'])} vs {len(b['records'])} (expected {STEPS})")
    expected = {f"{s}/" for s in ("actor", "critic", "actor_ema")}
    for side, w in ((a["variant"], wa), (b["variant"], wb)):
        missing = sorted(p for p in expected if not any(k.startswith(p) for k in w))
        if missing and not (missing == ["actor_ema/"] and case["ema"] == "off"):
            problems.append(f"{side} saved no {', '.join(missing)}")
    if not values and not weights and not problems:
        summary = f"identical ({len(a['records'])} steps, {len(wa)} tensors)"
    else:
        parts = list(problems)
        if values:
            i, key, x, y = values[0]
            parts.append(f"printed values: {len(values)} differ, first step {i} {key}: {x} vs {y}")
        if weights:
            biggest = max((float(w.split()[-1]) for _, w in weights if w.startswith("max |diff|")), default=None)
            order = list(wa)  # first differing tensor in saved order (actor, critic, EMA; module order)
            names = {n for n, _ in weights}
            first = next((n for n in order if n in names), weights[0][0])
            parts.append(f"weights: {len(weights)} of {len(set(wa) | set(wb))} tensors differ"
                         + (f", max |diff| {biggest:.3e}" if biggest is not None else "") + f", first {first}")
        summary = "differs (" + "; ".join(parts) + ")"
    return dict(identical=not values and not weights and not problems, values=values[:20],
                weights=weights[:40], summary=summary)


def engines_ok(result, case):
    expected = 2 * (5 if case["ema"] == "on" else 4)
    n = sum(result["engines"].values())
    problems = list(result["swap_problems"])
    if n != expected:
        problems.append(f"{n} engines built, expected {expected} (2 ranks)")
    if result["side"] == "upstream":
        foreign = [c for c in result["engines"] if c.startswith("deepspeed_multi.")]
        if foreign:
            problems.append(f"upstream built {foreign}")
    return problems


def refused_on_ours(result):
    """A deepspeed_multi refusal or a DeepSpeed assertion raised from our initialize."""
    text = open(os.path.join(result["dir"], "output.log"), errors="replace").read()
    return result["error"] is not None and ("deepspeed_multi" in (result["error"] or "") or
                                            re.search(r"deepspeed_multi/initialize\.py", text) is not None)


def run_key(case, args, fixed):
    """A case's key in results.json and its folder under cases/: the case, and how it was run where that
    is not the default (upstream's fix where auto would not choose it, shims left out, one side)."""
    key = case_id(case)
    if fixed != upstream_known_wrong(case):  # not what --fix-upstream auto runs
        key += f"-fix_{'on' if fixed else 'off'}"
    key += "".join(f"-no_{name}" for name in args.no_shim)
    if len(args.sides) == 1:
        key += f"-{args.sides[0]}_only"
    return key


def run_case(case, paths, args):
    fixed = args.fix_upstream == "on" or (args.fix_upstream == "auto" and upstream_known_wrong(case))
    cid = case["key"] = run_key(case, args, fixed)
    print(f"== {cid}", flush=True)
    shims_off = [x for name in args.no_shim for x in ("--no-shim", name)]
    patches = {"upstream": (["--fix-zero3-micro-step"] if fixed else []) + shims_off, "ours": shims_off}
    runs = {side: run_one(case, side, paths, args.out, side, patches[side], args.timeout) for side in args.sides}
    entry = dict(case={k: v for k, v in dict(case, pair=list(case["pair"])).items() if k != "key"}, id=cid,
                 package=paths["package"], upstream_label=FIXED_UPSTREAM if fixed else "upstream",
                 no_shim=args.no_shim,
                 seconds={k: r["seconds"] for k, r in runs.items()},
                 errors={k: r["error"] for k, r in runs.items() if r["error"]},
                 shims={k: r["shims"] for k, r in runs.items()},
                 engines={k: r["engines"] for k, r in runs.items()})
    up, ours = runs.get("upstream"), runs.get("ours")
    if up is None or ours is None:
        (side, r), = runs.items()
        entry["outcome"] = f"{side} only: " + ("ran" if r["rc"] == 0 else f"fails ({r['error']})")
    elif up["rc"] != 0 and ours["rc"] != 0:
        entry["outcome"] = f"both fail (upstream: {up['error']}; ours: {ours['error']})"
    elif up["rc"] == 0 and ours["rc"] != 0:
        kind = "refused on ours" if refused_on_ours(ours) else "fails on ours only"
        entry["outcome"] = f"{kind} ({ours['error']})"
    elif up["rc"] != 0:
        entry["outcome"] = f"fails upstream only ({up['error']})"
    else:
        cmp = compare(up, ours, case)
        entry.update(comparison=cmp, identical=cmp["identical"])
        entry["outcome"] = cmp["summary"]
    swap = {k: engines_ok(r, case) for k, r in runs.items() if r["rc"] == 0}
    entry["swap_problems"] = {k: v for k, v in swap.items() if v}
    if args.check_determinism and up is not None and up["rc"] == 0:
        again = run_one(case, "upstream", paths, args.out, "upstream-again", patches["upstream"], args.timeout)
        entry["seconds"]["upstream-again"] = again["seconds"]
        entry["determinism"] = (compare(up, again, case)["summary"] if again["rc"] == 0
                                else f"rerun failed: {again['error']}")
    if wants_one_backward(case, args) and ours is not None and ours["rc"] == 0:
        one = run_one(case, "ours", paths, args.out, "ours-one-backward", ["--one-backward"] + shims_off,
                      args.timeout)
        entry["seconds"]["ours-one-backward"] = one["seconds"]
        entry["one_backward"] = (compare(ours, one, case)["summary"] if one["rc"] == 0
                                 else f"fails: {one['error']}")
    label = "" if not fixed else f" [{FIXED_UPSTREAM}]"
    print(f"   -> {entry['outcome']}{label}" + (f"; swap: {entry['swap_problems']}" if entry["swap_problems"] else "")
          + (f"; determinism: {entry['determinism']}" if "determinism" in entry else "")
          + (f"; one backward vs ours: {entry['one_backward']}" if "one_backward" in entry else ""), flush=True)
    return entry


def wants_one_backward(case, args):
    """--one-backward alone: every case; --one-backward A,C ...: the cases at those pairs."""
    if args.one_backward is None:
        return False
    return not args.one_backward or tuple(case["pair"]) in {tuple(int(x) for x in p.split(",")) for p in args.one_backward}


def package(spec, out):
    """Where ours imports deepspeed_multi from: the repository's work tree as it is, or a commit's
    deepspeed_multi/ (git archive into <out>/package/<sha>) so that edits in progress in the work
    tree do not reach a run. Returns (python_path entries, description)."""
    import subprocess
    git = ["git", "-C", common.REPO]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if spec == "worktree":
        dirty = subprocess.run(git + ["status", "--porcelain", "--", "deepspeed_multi"], capture_output=True,
                               text=True).stdout.strip()
        return [], f"work tree (HEAD {head}{', deepspeed_multi/ with uncommitted changes' if dirty else ''})"
    sha = subprocess.run(git + ["rev-parse", spec], capture_output=True, text=True, check=True).stdout.strip()
    dest = os.path.join(out, "package", sha[:12])
    if not os.path.isdir(os.path.join(dest, "deepspeed_multi")):
        os.makedirs(dest, exist_ok=True)
        archive = subprocess.run(git + ["archive", sha, "deepspeed_multi"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return [dest], f"commit {sha[:12]}"


# ---------------------------------------------------------------------------------------- report
def write_report(out, results):
    rows = ["| run | actor,critic | ema | gas | offload | upstream side | ours: deepspeed_multi from | outcome | swap "
            "| seconds (upstream / ours) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cid in sorted(results):
        e = results[cid]
        c = e["case"]
        extra = []
        if "determinism" in e:
            extra.append(f"upstream run twice: {e['determinism']}")
        if "one_backward" in e:
            extra.append(f"ours with one loss.backward() vs ours: {e['one_backward']}")
        swap = "; ".join(f"{k}: {', '.join(v)}" for k, v in e.get("swap_problems", {}).items()) or "ok"
        outcome = (e["outcome"] + "".join(f"; {x}" for x in extra)).replace("|", "/")
        rows.append(f"| {cid} | {c['pair'][0]},{c['pair'][1]}{' hybrid' if c.get('hybrid') else ''} | {c['ema']} | "
                    f"{c['gas']} | {c['offload']} | {e['upstream_label']} | {e.get('package', '-')} | {outcome} | "
                    f"{swap} | {e['seconds'].get('upstream', '-')} / {e['seconds'].get('ours', '-')} |")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("# DeepSpeed-Chat step 3: upstream vs deepspeed_multi\n\n"
                "Written by tools/peer_programs/deepspeed_chat/run.py from results.json (every case run into this "
                "folder, the latest run of each).\n\n" + "\n".join(rows) + "\n")


def not_as_expected(entry, case, args):
    """What makes the exit status 1: ours not bit-identical to upstream where upstream ran (a refusal
    included), swap problems, a variant that differs; not upstream's known defect under --fix-upstream
    off, nor a case where both sides fail (the hybrid engine on CPU)."""
    known = upstream_known_wrong(case) and args.fix_upstream == "off"
    if entry.get("swap_problems"):
        return True
    if entry["outcome"].startswith(("refused on ours", "fails on ours only", "fails upstream only")):
        return True
    if "identical" in entry and not entry["identical"] and not known:
        return True
    return any(not entry[k].startswith("identical") for k in ("determinism", "one_backward") if k in entry)


def selection(args):
    if not any((args.pairs, args.ema, args.gas, args.offload)):
        cases = [dict(c) for c in DEFAULT_SELECTION]
    else:
        pairs = [tuple(int(x) for x in p.split(",")) for p in args.pairs] if args.pairs else [
            (a, c) for a in range(4) for c in range(4)]
        cases = [dict(pair=p, ema=e, gas=g, offload=o) for p, e, g, o in itertools.product(
            pairs, args.ema or [DEFAULT["ema"]], args.gas or [DEFAULT["gas"]], args.offload or [DEFAULT["offload"]])]
    for c in cases:
        c["hybrid"] = args.hybrid
    return cases


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="applications/DeepSpeed-Chat of a DeepSpeedExamples checkout")
    p.add_argument("--out", required=True, help="results folder (prepared inputs are kept there)")
    p.add_argument("--pairs", nargs="*", help="actor,critic ZeRO stage pairs, e.g. 2,3 3,3")
    p.add_argument("--ema", nargs="*", choices=["on", "off"])
    p.add_argument("--gas", nargs="*", type=int, choices=[1, 2])
    p.add_argument("--offload", nargs="*", choices=["on", "off"])
    p.add_argument("--fix-upstream", choices=["auto", "on", "off"], default="auto",
                   help="upstream's ZeRO-3 micro-step count at backward: auto = for critic ZeRO-3 with gas 2")
    p.add_argument("--one-backward", nargs="*", metavar="A,C", default=None,
                   help="also ours with one loss.backward(), vs ours: at every selected case, or at these pairs")
    p.add_argument("--hybrid", action="store_true", help="add --enable_hybrid_engine")
    p.add_argument("--check-determinism", action="store_true", help="run upstream twice and compare")
    p.add_argument("--sides", nargs="+", choices=common.SIDES, default=list(common.SIDES),
                   help="run one side only (no comparison), e.g. to see that a shim is needed")
    p.add_argument("--no-shim", action="append", default=[],
                   choices=["local_rank", "tensorboard", "no_init_weights", "save_vocabulary", "zero3_cast"],
                   help="leave one of launch.py's shims out (repeatable)")
    p.add_argument("--package", default="worktree",
                   help="deepspeed_multi for ours: 'worktree' (the repository as it is) or a git commit, e.g. HEAD")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    args = p.parse_args()
    main_py = os.path.join(args.src, "training", "step3_rlhf_finetuning", "main.py")
    if not os.path.exists(main_py) or not os.path.isdir(os.path.join(args.src, "dschat")):
        p.error(f"--src must be a DeepSpeed-Chat directory (with dschat/ and {main_py})")
    cases = selection(args)
    if args.list:
        for c in cases:
            print(case_id(c))
        return
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    paths = prepare(args.out, args.src)
    paths["package_path"], paths["package"] = package(args.package, args.out)
    print(f"ours imports deepspeed_multi from: {paths['package']}", flush=True)
    results_path = os.path.join(args.out, "results.json")
    results = json.load(open(results_path)) if os.path.exists(results_path) else {}
    bad = []
    start = time.time()
    for case in cases:
        entry = run_case(case, paths, args)
        results[entry["id"]] = entry
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
        write_report(args.out, results)
        if not_as_expected(entry, case, args):
            bad.append(entry["id"])
    print(f"\n{len(cases)} case(s) in {time.time() - start:.0f}s; report: {os.path.join(args.out, 'report.md')}")
    if bad:
        print("not identical or swap problems: " + ", ".join(sorted(set(bad))))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
