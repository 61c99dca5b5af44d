"""Accelerate's own DeepSpeed tests, upstream, through the drop-in and through deepspeed_multi's Accelerator.

    python tools/accelerate_suite/run.py --accelerate-src <an Accelerate checkout> --out <results dir>
        --test-packages <folder with parameterized> [--sides upstream,drop-in,accelerator,both] [-k EXPR]
        [--timeout S]

Accelerate's ``tests/deepspeed/`` (the multi-model file, test_deepspeed.py, the gradient-accumulation and ALST
tests, and the scripts they launch from the installed package's ``accelerate/test_utils/scripts/``) are the tests
Accelerate's multi-model guide points to. Nothing of them lives in this repository: they run from the checkout
given, with the installed Accelerate (its tests/deepspeed/ matches the installed release's scripts). Four sides:

* ``upstream``: as they are;
* ``drop-in``: ``deepspeed.initialize`` bound to ``deepspeed_multi.initialize`` in every process
  (tools/drop_in/sitecustomize.py);
* ``accelerator``: ``accelerate.Accelerator`` bound to ``deepspeed_multi.accelerate.Accelerator``;
* ``both``.

The shims every side needs on a CPU machine without a hub, each printing a line when it acts
(shim/sitecustomize.py): the gates that only choose a device lifted (``@require_non_cpu``,
``@require_multi_device``: two CPU ranks stand in), ``RUN_SLOW=1``, the hub ids the tests name mapped to tiny
local models with random weights (and word-level tokenizers) built here, ``load_dataset("nyu-mll/glue", "mrpc")``
a synthetic local MRPC (its validation split one label, which the classifier stand-in starts predicting: the
scripts assert an accuracy of 0.82), ``evaluate.load`` a local accuracy/F1, a script's ``tests/deepspeed/*.json``
path mapped to the checkout's, ``init_process_group(backend="nccl")`` gloo without CUDA, ``accelerate launch
--num_processes=2`` without a config the multi-process launcher, and Accelerate's state recording the real world
size on CPU (on CPU it records one process on every rank in DeepSpeed mode, where GPUs record the world). The
fp16 tests fail on CPU on every side (DeepSpeed: "Type fp16 is not supported on your device"): they are for a GPU.

Each rank's ``accelerator.backward`` losses are recorded (<out>/<side>/losses/<test>/rank<R>.jsonl) and compared
between sides for the multi-model script. Writes <out>/report.md and <out>/results.json; exit status 1 when a test
that passes upstream does not pass on a side of ours, or the multi-model script's losses differ from upstream's
through the drop-in.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SHIM = os.path.join(HERE, "shim")
SIDES = {"upstream": ("upstream", "upstream"), "drop-in": ("ours", "upstream"),
         "accelerator": ("upstream", "ours"), "both": ("ours", "ours")}  # side -> (deepspeed.initialize, Accelerator)
FILES = ["test_deepspeed_multiple_model.py", "test_deepspeed.py", "test_deepspeed_gradient_accumulation.py",
         "test_alst_ulysses_sp.py"]
MULTI_MODEL = "test_deepspeed_multiple_model.py::DeepSpeedConfigIntegration::test_train_multiple_models"
WORDS = [f"w{i}" for i in range(60)]


# ----------------------------------------------------------------------------------------------
# Inputs, made once per --out
# ----------------------------------------------------------------------------------------------

def prepare(assets):
    """Tiny stand-ins for the hub ids the tests and scripts name, and a synthetic MRPC; <assets>/models.json maps
    each id to its folder."""
    done = os.path.join(assets, "models.json")
    if os.path.exists(done):
        return
    import torch
    import transformers as tf
    from datasets import Dataset, DatasetDict
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(assets, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def tokenizer(**special):
        return tf.PreTrainedTokenizerFast(tokenizer_object=word_level, **special)

    built = {}

    def save(name, model, tok=None):
        folder = os.path.join(assets, name)
        model.save_pretrained(folder)
        if tok is not None:
            tok.save_pretrained(folder)
        built[name] = folder
        return folder

    torch.manual_seed(0)
    small = dict(vocab_size=len(vocab))
    gpt2 = save("gpt2", tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, **small)),
                tokenizer(pad_token="[PAD]", eos_token="[SEP]", bos_token="[CLS]"))
    # The scripts assert an MRPC accuracy (0.82) that no tiny random model reaches at lr 2e-5 in a few steps: the
    # stand-in's classifier starts sure of "paraphrase", the synthetic validation split's one label (below).
    classifier = tf.BertForSequenceClassification(tf.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
        **small))
    with torch.no_grad():
        classifier.classifier.bias.copy_(torch.tensor([-4.0, 4.0]))
    bert = save("bert", classifier, tokenizer(pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                              unk_token="[UNK]", mask_token="[MASK]"))
    # (The ALST script feeds token ids up to 228 of its own making.)
    llama = save("llama", tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=512, vocab_size=256)), tokenizer(pad_token="[PAD]", eos_token="[SEP]",
                                                                 bos_token="[CLS]"))
    moe = save("qwen_moe", tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        **small)))
    folder = os.path.join(assets, "mobilevit")
    tf.MobileViTConfig(image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32]
                       ).save_pretrained(folder)
    ids = {"hf-internal-testing/tiny-random-gpt2": gpt2, "sshleifer/tiny-gpt2": gpt2, "gpt2": gpt2,
           "bert-base-cased": bert, "distilbert-base-uncased": bert,
           "hf-internal-testing/tiny-random-LlamaForCausalLM": llama,
           "peft-internal-testing/tiny-random-qwen-1.5-MoE": moe, "apple/mobilevit-xx-small": folder}

    # MRPC's columns; label 1 exactly when the pair starts with the same word.
    g = torch.Generator().manual_seed(1)

    def rows(n, one_label=False):
        out = []
        for i in range(n):
            a = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (6,), generator=g)]
            b = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (6,), generator=g)]
            label = 1 if one_label else i % 2
            if label:
                b[0] = a[0]
            elif b[0] == a[0]:
                b[0] = WORDS[(WORDS.index(a[0]) + 1) % len(WORDS)]
            out.append({"sentence1": " ".join(a), "sentence2": " ".join(b), "label": label, "idx": i})
        return out
    DatasetDict({"train": Dataset.from_list(rows(128)), "validation": Dataset.from_list(rows(32, one_label=True)),
                 "test": Dataset.from_list(rows(32, one_label=True))}).save_to_disk(os.path.join(assets, "mrpc"))
    with open(done, "w") as f:
        json.dump(ids, f, indent=1)


# ----------------------------------------------------------------------------------------------
# One side
# ----------------------------------------------------------------------------------------------

def side_env(side, ctx):
    """The environment of every process of one side: the shims first on PYTHONPATH, the side's swaps, no hub."""
    out = os.path.join(ctx.out, side)
    initialize, accelerator = SIDES[side]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(DS_ACCELERATOR="cpu", DSM_DROP_IN_SIDE=initialize, DSM_DROP_IN_LOG=os.path.join(out, "drop_in.log"),
               DSM_ACC_SUITE_ASSETS=ctx.assets, DSM_ACC_SUITE_SRC=ctx.src, DSM_ACC_SUITE_ACCELERATOR=accelerator,
               DSM_ACC_SUITE_RECORD_ROOT=os.path.join(out, "losses"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join([SHIM, REPO, ctx.packages] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                      else []))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # (`accelerate launch`)
    return env


def run_side(side, ctx):
    out = os.path.join(ctx.out, side)
    os.makedirs(out, exist_ok=True)
    env = side_env(side, ctx)
    junit = os.path.join(out, "junit.xml")
    tests = [os.path.join(ctx.src, "tests", "deepspeed", f) for f in FILES]
    cmd = [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", "-q", "-rA", f"--junitxml={junit}",
           f"--timeout={ctx.timeout}", "-o", "addopts="]
    if ctx.k:
        cmd += ["-k", ctx.k]
    start = time.time()
    with open(os.path.join(out, "output.log"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        subprocess.call(cmd, cwd=os.path.join(ctx.src, "tests"), env=env, stdout=log, stderr=subprocess.STDOUT)
    outcomes = read_junit(junit)
    counts = collections.Counter(outcomes.values())
    print(f"  {side:<12} {dict(counts)} in {time.time() - start:.0f} s", flush=True)
    return outcomes


def read_junit(path):
    """test id -> "passed" | "failed" | "skipped" (with the reason)."""
    found = {}
    if not os.path.exists(path):
        return found
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            found[name] = "failed"
        elif case.find("skipped") is not None:
            found[name] = "skipped: " + (case.find("skipped").get("message") or "")[:80]
        else:
            found[name] = "passed"
    return found


# The multi-model script as launched by test_train_multiple_models, and two copies under <out>/scripts/, each with
# edits that leave its training as it is: its 0-dim bf16 noise parameter 1-dim, so that upstream gets past prepare()
# (DeepSpeed's start-up broadcast fails on a 0-dim 16-bit parameter), and that with main() running the second phase
# alone (two models, a second Accelerator, one accumulate() over both), since the first phase ends on the script's
# accuracy assertion on every side (tiny random models do not improve on the synthetic MRPC at lr 2e-5).
SCRIPT = ("test_utils", "scripts", "external_deps", "test_ds_multiple_model.py")
ONE_DIM = ("torch.tensor(noise_factor, dtype=torch.float32)", "torch.tensor([noise_factor], dtype=torch.float32)")
SECOND_PHASE = ("    single_model_training(config, args)\n", "")
VARIANTS = {"script-as-shipped": (), "script-1dim-noise": (ONE_DIM,), "script-two-accelerators": (ONE_DIM,
                                                                                                    SECOND_PHASE)}


def run_script(side, variant, ctx):
    """One launch of the multi-model script on ``side`` (2 ranks, one epoch); returns the last error line of its
    log ("" when it exited 0)."""
    import accelerate
    script = os.path.join(os.path.dirname(accelerate.__file__), *SCRIPT)
    if VARIANTS[variant]:
        with open(script) as f:
            text = f.read()
        for old, new in VARIANTS[variant]:
            assert old in text, f"{script} no longer holds {old!r}: update VARIANTS"
            text = text.replace(old, new)
        script = os.path.join(ctx.out, "scripts", f"{variant}.py")
        os.makedirs(os.path.dirname(script), exist_ok=True)
        with open(script, "w") as f:
            f.write(text)
    env = side_env(side, ctx)
    os.makedirs(os.path.join(ctx.out, side), exist_ok=True)
    env["PYTEST_CURRENT_TEST"] = f"script::{variant} (call)"  # where the shim records the losses
    env["DSM_ACC_SUITE_SEED"] = "42"  # the seed the script names and never applies (shim/sitecustomize.py)
    # (Accelerate's CLI, as the test launches it: `python -m accelerate.commands.launch` would run the launcher as
    # __main__, which the launch shim does not see.)
    cli = "from accelerate.commands.accelerate_cli import main; main()"
    cmd = [sys.executable, "-c", cli, "launch", "--num_processes=2", "--num_machines=1", "--main_process_port=0",
           script, "--num_epochs", "1"]
    with open(os.path.join(ctx.out, side, f"{variant}.log"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, cwd=ctx.out, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=ctx.timeout)
    ended = ""
    if rc != 0:
        with open(log.name, errors="replace") as f:
            errors = [line.split("]:", 1)[-1].strip() for line in f if line.startswith("[rank") and "Error" in line]
        ended = errors[-1] if errors else f"exit {rc}"
    print(f"  {side:<12} {variant:<24} {ended or 'ok'}", flush=True)
    return ended


def losses(ctx, side, test="test_train_multiple_models"):
    """{rank file: [loss, ...]} the ranks of ``test`` recorded on ``side``."""
    folder = os.path.join(ctx.out, side, "losses", test)
    if not os.path.isdir(folder):
        return {}
    found = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            found[name] = [json.loads(line)["loss"] for line in f]  # (the RNG digests beside them: for reading)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerate-src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--test-packages", required=True,
                    help="a `pip install --target` folder with what Accelerate's tests import (parameterized)")
    ap.add_argument("-k", help="pytest -k expression")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test")
    args = ap.parse_args()
    ctx = argparse.Namespace(src=os.path.abspath(args.accelerate_src), out=os.path.abspath(args.out), k=args.k,
                             timeout=args.timeout, packages=os.path.abspath(args.test_packages))
    ctx.assets = os.path.join(ctx.out, "assets")
    prepare(ctx.assets)
    sides = args.sides.split(",")
    results = {side: run_side(side, ctx) for side in sides}
    upstream = results.get("upstream", {})
    lost = {side: sorted(t for t, o in upstream.items() if o == "passed" and found.get(t) != "passed")
            for side, found in results.items() if side != "upstream"}
    scripts = {(side, v): run_script(side, v, ctx) for side in sides for v in VARIANTS}
    compared = ("script-1dim-noise", "script-two-accelerators")
    recorded = {(side, v): losses(ctx, side, v) for side in sides for v in compared}
    same_losses = {f"{side} {v}": (recorded[(side, v)] == recorded.get(("upstream", v)) if recorded[(side, v)]
                                   else None) for side in sides if side != "upstream" for v in compared}
    lines = ["# Accelerate's DeepSpeed tests: upstream and through deepspeed_multi", "",
             "| test | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
    for test in sorted(set().union(*results.values())):
        lines.append(f"| {test} | " + " | ".join(results[s].get(test, "-").replace("|", "/") for s in sides) + " |")
    for variant in VARIANTS:
        lines.append(f"| multi-model {variant} (how it ended) | " +
                     " | ".join((scripts[(s, variant)] or "ok").replace("|", "/") for s in sides) + " |")
    counts = {v: sum(len(x) for x in recorded.get(("upstream", v), {}).values()) for v in compared}
    lines += ["", "Upstream passes lost: " + "; ".join(f"{s}: {len(v)} {v}" for s, v in lost.items()),
              f"The multi-model script's losses (every rank, every backward; upstream recorded {counts}) equal "
              "upstream's: " + "; ".join(f"{s}: {v}" for s, v in same_losses.items())]
    with open(os.path.join(ctx.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(ctx.out, "results.json"), "w") as f:
        json.dump({"results": results, "lost": lost, "same_losses": same_losses,
                   "scripts": {f"{s} {v}": ended for (s, v), ended in scripts.items()}}, f, indent=1)
    print("\n".join(lines))
    # Ours must record upstream's numbers through the drop-in, and end every script as upstream ends it (the script's
    # own accuracy assertion), or better (the 0-dim parameter upstream cannot build).
    failed = any(lost.values()) or any(same_losses.get(f"drop-in {v}") is not True for v in compared)
    failed |= any(ended not in ("", scripts.get(("upstream", v))) and "AssertionError" not in ended
                  for (side, v), ended in scripts.items() if side != "upstream")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
