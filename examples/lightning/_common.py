"""Shared by the Lightning examples: launch environment, the strategy choice, the loss check.

Each example is a Lightning program written as for DDP; only the strategy line differs:

    torchrun --standalone --nproc_per_node=2 examples/lightning/<name>.py [--short] [--strategy ...]

``--strategy multi`` (the default) is deepspeed_multi's; ``ddp`` is Lightning's DDP (the same
program, the reference); ``deepspeed`` is Lightning's own DeepSpeedStrategy with the same config
(on a machine without GPUs its CUDA-only check is lifted, to show what happens after it).
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
    """Before Lightning/DeepSpeed are imported: a world of one for plain `python`, CPU if no GPU."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29539").items():
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator on import
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    warnings.filterwarnings("ignore")
    for name in ("deepspeed", "DeepSpeed", "lightning", "lightning.fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.WARNING)


def parser(description, steps):
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--short", action="store_true", help="a few steps (what `make test` runs)")
    ap.add_argument("--strategy", choices=("multi", "ddp", "deepspeed"), default="multi")
    return ap


def accelerator() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def devices() -> int:
    return int(os.environ["WORLD_SIZE"])


def config(stage, micro_bs, **extra):
    """The strategy's DeepSpeed config; each model's own overrides it where it differs."""
    return {"train_micro_batch_size_per_gpu": micro_bs, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def plain_deepspeed(module, **kwargs):
    """Lightning's own DeepSpeedStrategy (``module``: lightning.fabric.strategies or
    lightning.pytorch.strategies); on CPU with its CUDA-only check lifted (devices ``cpu:<rank>``, so
    that its device-index checks pass), to show what happens after it."""
    if torch.cuda.is_available():
        return module.DeepSpeedStrategy(**kwargs)

    class CPUDeepSpeedStrategy(module.DeepSpeedStrategy):
        def setup_environment(self):
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            module.DDPStrategy.setup_environment(self)   # what DeepSpeedStrategy runs after its CUDA check

    return CPUDeepSpeedStrategy(**kwargs)


def strategy(choice, config, configs, trainer=False):
    """The strategy ``--strategy`` names, over the example's DeepSpeed ``config`` (each model's own
    ``configs`` over it, for ours): the one line a user changes."""
    if choice == "ddp":
        from lightning.pytorch.strategies import DDPStrategy
        # the Trainer's GAN runs backward passes that reach one of its two models
        return DDPStrategy(find_unused_parameters=True) if trainer else "ddp"
    if choice == "deepspeed":
        if trainer:
            from lightning.pytorch import strategies
        else:
            from lightning.fabric import strategies
        return plain_deepspeed(strategies, config=config)
    from deepspeed_multi import lightning
    cls = lightning.MultiDeepSpeedTrainerStrategy if trainer else lightning.MultiDeepSpeedStrategy
    return cls(config=config, configs=configs)


def check_falling(print_fn, name, history, short):
    """Print first vs last losses (means over a fifth of the run); fail if the loss did not fall."""
    k = max(1, len(history) // 5)
    first, last = sum(history[:k]) / k, sum(history[-k:]) / k
    print_fn(f"{name}: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
    if not last < first:
        raise SystemExit(f"{name} did not fall ({first:.4f} -> {last:.4f})")


def end():
    """Destroy the process group before exiting (a gloo job whose groups are alive at exit can die in
    std::terminate after finishing its work; docs/failure_and_recovery.md)."""
    import gc
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
