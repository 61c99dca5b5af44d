"""Rank functions for DeepSpeed's newer training features in multi-engine programs (test_deepspeed_api.py):
torch_autocast's fp16 GradScaler, Muon, ZenFlow, SuperOffload. The matrix's ``knob-torch-autocast-*``
rows measure torch_autocast's gradients; these check what a row cannot."""
import deepspeed.comm as dist
import torch

import deepspeed_multi
from common import FP32_TOL, MLP, ds_config, full_params


def _batch(step, rank=None):
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(300 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def autocast_fp16_overflow_skips_on_every_rank(stage):
    """One rank's gradient overflows in one element: every rank skips the update and halves the scale,
    as DDP's GradScaler on the all-reduced gradient ([Note: torch_autocast's GradScaler]; DeepSpeed
    skipped without backing off, so the same scale overflowed again)."""
    rank = dist.get_rank()
    cfg = ds_config(stage, torch_autocast={"enabled": True, "dtype": "float16"})
    model = MLP(seed=1)
    poison = {"on": False}

    def overflow_here(grad):
        if poison["on"] and rank == 0:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    model.fc2.weight.register_hook(overflow_here)
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=cfg)[0]
    scaler = engine.torch_autocast_z0_gradscaler or engine.optimizer.torch_autocast_gradscaler
    x, y = _batch(0)
    ((engine(x) - y) ** 2).mean().backward()
    engine.step()
    before, scale = full_params(engine), scaler.get_scale()
    assert any((v != 0).any() for v in before.values())
    poison["on"] = True
    x, y = _batch(1)
    ((engine(x) - y) ** 2).mean().backward()
    engine.step()
    after = full_params(engine)
    moved = max((after[n] - before[n]).abs().max().item() for n in before)
    scales = [None] * dist.get_world_size()
    dist.all_gather_object(scales, scaler.get_scale())
    assert moved == 0, (f"ZeRO-{stage} fp16 torch_autocast, rank {rank}: rank 0 overflowed but the update "
                        f"moved parameters by {moved:.3e} (the ranks must skip together)")
    assert scales == [scale / 2] * len(scales), f"ZeRO-{stage}: loss scales after the overflow {scales}, want {scale / 2}"
    engine.destroy()


def all_features():
    for stage in (0, 1, 2, 3):
        autocast_fp16_overflow_skips_on_every_rank(stage)
