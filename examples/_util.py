"""Shared setup for the examples: pick the backend, start the process group, small helpers.

Every example runs unchanged on CPU (gloo, ``DS_ACCELERATOR=cpu``) and on GPUs (NCCL, one GPU per
rank), launched with ``torchrun --standalone --nproc_per_node=2 examples/<name>.py``. Run with a
plain ``python examples/<name>.py`` it becomes a single-process run (world size 1).
"""
import atexit
import logging
import os
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def setup(seed: int = 0):
    """Start the process group; return (device, rank, world_size)."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29533").items():
        os.environ.setdefault(key, value)  # plain `python example.py`: a world of one
    gpu = torch.cuda.is_available()
    if not gpu:
        # Must be set before deepspeed is imported: DeepSpeed picks its accelerator on import.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed deprecations inside DeepSpeed
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)  # engine construction logs a lot at INFO
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo", verbose=False)
    # Destroy the process group at exit: a gloo job whose groups are alive when Python exits can die in
    # std::terminate after finishing its work (pytorch/pytorch#190489; docs/failure_and_recovery.md).
    atexit.register(_destroy_process_group)
    torch.manual_seed(seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    return dev, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _destroy_process_group():
    if torch.distributed.is_initialized():
        import gc
        gc.collect()  # engines left in reference cycles go while the interpreter is whole
        torch.distributed.barrier()  # no rank tears its groups down under a peer's last collective
        torch.distributed.destroy_process_group()


def ds_config(stage, micro_bs=8, gas=1, dtype="fp32", **extra):
    """A DeepSpeed config for one engine. Each engine gets its own, so stages can differ."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,          # DeepSpeed's default is 1.0
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,  # we pass plain torch optimizers
        "zero_optimization": {"stage": stage,
                              # tiny models: partition every parameter, or ZeRO-3 keeps them whole
                              "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def rank0_print(*args, **kw):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kw, flush=True)


def progress(n, desc):
    """``range(n)`` with a progress bar on rank 0 (tqdm if installed, else a printed counter)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return range(n)
    try:
        from tqdm import tqdm
        return tqdm(range(n), desc=desc, ncols=80, mininterval=0.5)
    except ImportError:
        def counter():
            for i in range(n):
                if i % max(1, n // 10) == 0:
                    print(f"{desc}: {i}/{n}", flush=True)
                yield i
            print(f"{desc}: {n}/{n}", flush=True)
        return counter()


def all_mean(value: float) -> float:
    """Mean of a python float over ranks (for printing losses)."""
    import deepspeed.comm as dist
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


class Block(nn.Module):
    """A pre-LN transformer block (causal self-attention + 4x MLP)."""

    def __init__(self, d, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def mlp(d_in, d_hidden, d_out):
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))
