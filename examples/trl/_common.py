"""Shared by the Trainer and TRL examples: environment, a tiny model and tokenizer, the DeepSpeed
config, and the check that the run learned something.

Each example runs on CPU (gloo) or GPUs with

    torchrun --standalone --nproc_per_node=2 examples/trl/<name>.py [--short]

(on CPU: ``DS_ACCELERATOR=cpu``, set here when no GPU is visible). Models are Transformers
classes built from small configs with random weights and the tokenizer is built from a local word
vocabulary, so nothing is downloaded. The task is learnable in a few steps: sequences that count
upwards (``w7 w8 w9 ...``).
"""
import argparse
import functools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VOCAB = 64  # w3 .. w63, plus <pad> <s> </s>


@functools.lru_cache(maxsize=None)
def _hf_common():
    """examples/hf/_common.py, whose environment set-up these examples share."""
    import importlib.util
    path = os.path.join(ROOT, "examples", "hf", "_common.py")
    spec = importlib.util.spec_from_file_location("examples_hf_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Before Accelerate/DeepSpeed are imported: a world of one for plain `python`, CPU if no GPU.
setup_env = _hf_common().setup_env


def parser(description):
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="a few steps, no progress bar (what `make test` runs)")
    ap.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    return ap


def common_args(args, **kw):
    """TrainingArguments fields every example shares; CPU when no GPU is visible."""
    cpu = not torch.cuda.is_available()
    out = dict(output_dir=args.out or _run_dir(), logging_steps=1,
               save_strategy="no", report_to=[], use_cpu=cpu, bf16=False, seed=0, disable_tqdm=args.short,
               lr_scheduler_type="constant", max_grad_norm=1.0)
    out.update(kw)
    return out


def _run_dir():
    """A temporary directory that every rank of this launch names alike, removed at exit."""
    import atexit
    import shutil
    import tempfile
    path = os.path.join(tempfile.gettempdir(), f"dsm_example_{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}")
    if os.environ.get("RANK", "0") == "0":
        atexit.register(shutil.rmtree, path, True)
    return path


def ds_config(stage):
    """The trained model's DeepSpeed config; "auto" values come from the TrainingArguments."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def tiny_llama(num_labels=None):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      **({} if num_labels is None else {"num_labels": num_labels}))
    cls = AutoModelForCausalLM if num_labels is None else AutoModelForSequenceClassification
    return cls.from_config(cfg)


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def counting(g, n):
    """``n`` words counting upwards from a random start (wrapping within w3..w63)."""
    start = int(torch.randint(0, VOCAB - 3, (1,), generator=g))
    return " ".join(f"w{3 + (start + i) % (VOCAB - 3)}" for i in range(n))


def random_words(g, n):
    return " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))


def trend(key, falls=True):
    """A TrainerCallback that prints which engines train as training starts, keeps ``key`` from
    each step's logs and, with ``.check(trainer, what)`` at the end, checks its trend."""
    from transformers import TrainerCallback

    class Trend(TrainerCallback):
        def __init__(self):
            self.history = []

        def on_train_begin(self, args, state, control, **kw):
            if state.is_world_process_zero:
                print(describe(self.trainer), flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and key in logs:
                self.history.append(float(logs[key]))

        def check(self, what):
            """First vs last (means over a fifth of the run, at least 2 steps); exits non-zero
            if the value did not move the expected way."""
            k = max(2, len(self.history) // 5)
            if len(self.history) < 2 * k:
                raise SystemExit(f"{what}: only {len(self.history)} logged steps of {key!r}")
            first, last = sum(self.history[:k]) / k, sum(self.history[-k:]) / k
            if self.trainer.is_world_process_zero():
                print(f"{what} {key}: first {k} steps {first:.4f} -> last {k} steps {last:.4f}", flush=True)
            if not (last < first if falls else last > first):
                raise SystemExit(f"{what}: {key} did not {'fall' if falls else 'rise'} ({first:.4f} -> {last:.4f})")

    return Trend()


def end(trainer):
    """examples/hf/_common.end for the Trainer's Accelerator (rank 0 may still be writing the saved
    model when the others get there)."""
    _hf_common().end(trainer.accelerator)


def watch(trainer, key, falls=True):
    """Attach :func:`trend` to ``trainer``; returns it."""
    callback = trend(key, falls)
    callback.trainer = trainer
    trainer.add_callback(callback)
    return callback


def describe(trainer):
    """One line: each engine the Accelerator holds, its stage and whether it trains."""
    parts = []
    for engine in trainer.accelerator.engines():
        role = getattr(engine, "_dsm_role", None) or "model"
        parts.append(f"{role} {type(engine.module).__name__} ZeRO-{engine.zero_optimization_stage()} "
                     f"({'trained' if engine.has_optimizer else 'frozen'})")
    return "; ".join(sorted(parts)) + f"; world size {trainer.accelerator.num_processes}"
