"""Shared by the Hugging Face examples: environment, configs, model loading, progress, loss check.

Each example runs with either launcher on CPU (gloo) or GPUs:

    torchrun --standalone --nproc_per_node=2 examples/hf/<name>.py [--short]
    accelerate launch --multi_gpu --num_processes 2 examples/hf/<name>.py [--short]
    accelerate launch --use_deepspeed --deepspeed_config_file cfg.json --num_processes 2 examples/hf/<name>.py

With ``--deepspeed_config_file`` the file's config is used for the example's first trained model,
and the other models keep their own configs (per-call configs in prepare()). Models are real
Transformers classes built from small configs with random weights, so nothing is downloaded;
``--model NAME_OR_PATH`` loads a checkpoint instead.
"""
import argparse
import logging
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def setup_env():
    """Before Accelerate/DeepSpeed are imported: a world of one for plain `python`, CPU if no GPU."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29537").items():
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator on import
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("deepspeed").setLevel(logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def parser(description, steps):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--short", action="store_true", help="a few steps (what `make test` runs)")
    ap.add_argument("--model", default=None, help="load this checkpoint (name or path) instead of a tiny random model")
    ap.add_argument("--bf16", action="store_true", help="bf16 in every engine's config")
    return ap


def ds_config(stage, micro_bs, gas=1, bf16=False, **extra):
    """One engine's DeepSpeed config; each model gets its own, so stages can differ."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
    }
    cfg.update(extra)
    return cfg


def launch_config(default):
    """The config given to `accelerate launch --deepspeed_config_file`, if any, else ``default``."""
    return os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or default


def accelerator(plugins):
    """A deepspeed_multi Accelerator holding one DeepSpeedPlugin per model (the guide's dict)."""
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_multi.accelerate import Accelerator
    return Accelerator(deepspeed_plugins={name: DeepSpeedPlugin(hf_ds_config=cfg) for name, cfg in plugins.items()})


def tiny_llama(vocab=96, hidden=32, layers=2, **kw):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kw)


def causal_lm(model_name, config):
    """``--model`` checkpoint, else a random model of ``config``; built under the selected plugin."""
    from transformers import AutoModelForCausalLM
    if model_name:
        return AutoModelForCausalLM.from_pretrained(model_name)
    return AutoModelForCausalLM.from_config(config)


def progress(accel, n, desc):
    if not accel.is_main_process:
        return range(n)
    from tqdm import tqdm
    return tqdm(range(n), desc=desc, ncols=90, mininterval=0.5)


def mean_over_ranks(accel, value: float) -> float:
    t = torch.tensor([float(value)], device=accel.device)
    return accel.reduce(t, reduction="mean").item()


def check_falling(accel, name, history, short):
    """Print first vs last losses (means over a fifth of the run); fail if the loss did not fall."""
    k = max(1, len(history) // 5)
    first, last = sum(history[:k]) / k, sum(history[-k:]) / k
    accel.print(f"{name}: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
    if not last < first:
        raise SystemExit(f"{name} did not fall ({first:.4f} -> {last:.4f})")


def end(accel):
    """Destroy the process group before exiting: a gloo job whose groups are alive when Python exits can
    die in std::terminate after finishing its work (pytorch/pytorch#190489; docs/failure_and_recovery.md).
    The ranks first wait for each other and the engines are destroyed and collected, so that no rank
    tears its groups down under a peer's last collective and nothing of the engines' (a pending
    collective's work object) is left for the interpreter's finalization to free."""
    import gc
    accel.wait_for_everyone()
    accel.free_memory()
    gc.collect()
    accel.end_training()
