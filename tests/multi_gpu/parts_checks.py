"""One model, several ZeRO stages (deepspeed_multi/parts): a tiny multimodal model (ViT encoder ->
projector -> Llama through inputs_embeds) trained as parts, against the same model in plain PyTorch
on the same global batch (one AdamW with a no-decay group, one LambdaLR, clip on the whole norm)."""
import copy
import os
import tempfile

import torch
import torch.nn as nn

import deepspeed.comm as dist
import hf_models as hm
from common import FP32_TOL, ds_config, full_params

import deepspeed_multi

IMAGE_TOKENS = 5  # (8 / 4) ** 2 patches + CLS


class MM(nn.Module):
    """The LLaVA layout: vision_tower -> projector -> language_model(inputs_embeds=...)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.vision_tower = hm.vit_encoder()
        self.projector = nn.Sequential(nn.Linear(hm.HIDDEN, hm.HIDDEN), nn.GELU(), nn.Linear(hm.HIDDEN, hm.HIDDEN))
        self.language_model = hm.causal_lm()

    def forward(self, pixel_values, input_ids, labels):
        image = self.vision_tower(pixel_values=pixel_values.to(self.projector[0].weight.dtype)).last_hidden_state
        image = self.projector(image)
        text = self.language_model.get_input_embeddings()(input_ids)
        embeds = torch.cat([image.to(text.dtype), text], dim=1)
        ignore = torch.full((labels.shape[0], image.shape[1]), -100, dtype=labels.dtype, device=labels.device)
        return self.language_model(inputs_embeds=embeds, labels=torch.cat([ignore, labels], dim=1)).loss


def batch(step, rank, n=2, length=6):
    g = torch.Generator().manual_seed(7919 * step + rank)
    ids = hm.tokens(g, n, length)
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g), "input_ids": ids, "labels": ids.clone()}


def groups(model, weight_decay=0.1):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def schedule(step):
    return 1.0 / (1.0 + step)  # a learning rate that changes at every update


def case_config(top_stage, submodules, gas, clip, dtype="fp32"):
    cfg = ds_config(stage=top_stage, dtype=dtype, gas=gas, micro_bs=2, gradient_clipping=clip)
    cfg["deepspeed_multi"] = {"submodules": {name: {"zero_optimization": {"stage": s}}
                                             for name, s in submodules.items()}}
    return cfg


def reference(windows, gas, clip, lr, world):
    model = MM()
    opt = torch.optim.AdamW(groups(model), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    norms = []
    for step in range(windows * gas):
        for r in range(world):
            (model(**batch(step, r)) / (world * gas)).backward()
        if (step + 1) % gas == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    return model, norms


def train(engine, windows, gas, start=0):
    rank = dist.get_rank()
    norms = []
    for step in range(start, windows * gas):
        loss = engine(**batch(step, rank))
        loss.backward()
        engine.step()
        if (step + 1) % gas == 0:
            norms.append(engine.get_global_grad_norm())
    return norms


def build(top_stage, submodules, gas, clip, lr, dtype="fp32"):
    model = MM()
    opt = torch.optim.AdamW(groups(model), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    engine, optimizer, _, scheduler = deepspeed_multi.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=case_config(top_stage, submodules, gas, clip, dtype))
    return engine, optimizer, scheduler


def check_exact(top_stage, submodules, gas, clip=0.5, windows=3, lr=1e-2):
    """fp32: every parameter, the logged norms and the learning rate equal plain PyTorch's (1e-5)."""
    what = f"top ZeRO-{top_stage}, parts {submodules}, gas {gas}, clip {clip}"
    engine, optimizer, scheduler = build(top_stage, submodules, gas, clip, lr)
    stages = engine.zero_optimization_stages()
    for name, stage in submodules.items():
        assert stages[name] == stage, (what, stages)
    if len(stages) > len(submodules):
        assert stages["_rest"] == top_stage, (what, stages)
    assert isinstance(engine.module, MM) and engine.module.language_model is not None
    got_norms = train(engine, windows, gas)
    ref, want_norms = reference(windows, gas, clip, lr, dist.get_world_size())
    assert set(engine.module.state_dict()) == set(ref.state_dict()), what
    for got, want in zip(got_norms, want_norms):
        assert abs(got - want) <= 1e-5 * max(1.0, want), (what, got_norms, want_norms)
    if clip > 0:
        assert max(want_norms) > clip, f"{what}: the clip never engaged (norms {want_norms}); the case tests nothing"
    assert abs(engine.get_lr()[0] - scheduler.get_last_lr()[0]) < 1e-12 and abs(
        scheduler.get_last_lr()[0] - lr * schedule(windows)) < 1e-12, (what, engine.get_lr(), scheduler.get_last_lr())
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
    got = full_params(engine.module)
    want = {n: p.detach().float() for n, p in ref.named_parameters()}
    err = max((got[n] - want[n]).abs().max().item() for n in want)
    moved = max((want[n] - p.detach().float()).abs().max().item() for n, p in MM().named_parameters())
    assert moved > 1e-3, f"{what}: the reference did not move"
    assert err <= FP32_TOL, f"{what}: max abs error {err:.3e} vs plain PyTorch"
    return err


def check_resume(top_stage, submodules, gas, clip=0.5, windows=4, lr=1e-2):
    """Save after two windows, resume in freshly built engines: the same weights as an uninterrupted run."""
    rank = dist.get_rank()
    engine, _, _ = build(top_stage, submodules, gas, clip, lr)
    train(engine, 2, gas)
    root = [tempfile.mkdtemp(prefix="dsm_parts_") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    engine.save_checkpoint(root[0], client_state={"windows": 2})
    resumed, _, _ = build(top_stage, submodules, gas, clip, lr)
    _, client_state = resumed.load_checkpoint(root[0])
    assert client_state == {"windows": 2}, client_state
    train(resumed, windows, gas, start=2 * gas)
    ref, _ = reference(windows, gas, clip, lr, dist.get_world_size())
    got = full_params(resumed.module)
    err = max((got[n] - p.detach().float()).abs().max().item() for n, p in ref.named_parameters())
    assert err <= FP32_TOL, f"resume {top_stage} {submodules}: max abs error {err:.3e}"
    dist.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(root[0], ignore_errors=True)


def run_all():
    for enc in (0, 1, 2):
        for gas in (1, 2):
            check_exact(enc, {"language_model": 3}, gas)
    check_exact(1, {"vision_tower": 2, "language_model": 3}, 2)  # three parts: projector is the rest
    check_exact(3, {"vision_tower": 2}, 2, clip=0.0)  # the rest (projector + LLM) at ZeRO-3
    check_resume(2, {"language_model": 3}, 2)
