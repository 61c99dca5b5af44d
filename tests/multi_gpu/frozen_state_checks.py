"""Rank functions for test_checkpoint.py: engines without an optimizer whose state changes, resumed.

A program: a trainable ``body`` -> a frozen residual ``prior`` with BatchNorm (in train mode its
running statistics change every step, rank by rank; in eval mode they hold) -> a trainable ``head``,
and a frozen ``teacher`` of the head's shape, updated in place after every step: an EMA of the head
(DINO/BYOL) or a copy of it every second step (a reference synced from the policy), at ZeRO-3 under
``GatheredParameters(..., modifier_rank=0)``. The loss is the task loss plus a distillation term on
the teacher's output.

Each case runs three times on the same global batch: the uninterrupted run (a set checkpoint saved on
the way), a resume into engines ALL built from other weights (frozen ones included), which must end
bit-identical, and DDP (trained models wrapped in DistributedDataParallel, frozen ones plain modules
on every rank), which the uninterrupted run must match within FP32_TOL, buffers rank by rank.
"""
import os

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn

import deepspeed_multi
from common import FP32_TOL, MLP, ds_config, full_params

SAVE_AT, TOTAL = 2, 5


class Prior(nn.Module):
    """x + tanh(BN(Wx)); BatchNorm's running statistics start from the seed, so a model built from
    other weights differs in its buffers too."""

    def __init__(self, seed, bn_train):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        with torch.no_grad():
            for t in list(self.parameters()) + [self.bn.running_mean]:
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
            self.bn.running_var.copy_(torch.rand(8, generator=g) + 0.5)
        self.requires_grad_(False)
        self.train(bn_train)

    def forward(self, x):
        return x + torch.tanh(self.bn(self.fc(x)))


# case -> (body stage, prior stage, prior BatchNorm in train mode, head stage, teacher stage, teacher update)
CASES = {
    "ema_z3_teacher_bn_train_z0": (3, 0, True, 1, 3, "ema"),
    "sync_z0_teacher_bn_eval_z3": (2, 3, False, 2, 0, "sync"),
    "sync_z3_teacher_bn_train_z3": (1, 3, True, 3, 3, "sync"),
    "ema_z3_teacher_bn_eval_z0": (0, 0, False, 2, 3, "ema"),
}


def _modules(case, seed):
    _, _, bn_train, _, _, _ = CASES[case]
    return {"body": MLP(seed=seed + 1), "prior": Prior(seed + 2, bn_train), "head": MLP(seed=seed + 3),
            "teacher": MLP(seed=seed + 4).requires_grad_(False)}


def _build(case, seed):
    body, prior, bn_train, head, teacher, _ = CASES[case]
    stages = {"body": body, "prior": prior, "head": head, "teacher": teacher}
    engines = {}
    for name, module in _modules(case, seed).items():
        cfg = ds_config(stages[name])
        if name in ("body", "head"):
            opt = torch.optim.Adam(module.parameters(), lr=1e-2)
            engines[name] = deepspeed_multi.initialize(model=module, optimizer=opt, config=cfg)[0]
        else:
            engines[name] = deepspeed_multi.initialize(model=module, config=cfg)[0]
    return engines


def _batch(step):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)


def _loss(m, x, y):
    mid = m["prior"](m["body"](x))
    out = m["head"](mid)
    return ((out - y)**2).mean() + 0.5 * ((out - m["teacher"](mid).detach())**2).mean()


def _update_teacher(teacher, head, step, how):
    """EMA of the head (alpha 0.8) every step, or a copy of it every second step; at ZeRO-3 the
    teacher is gathered and rank 0's update is broadcast (DeepSpeed's modifier_rank)."""
    if how == "sync" and step % 2:
        return
    alpha = 0.8 if how == "ema" else 0.0
    t_params, h_params = list(teacher.parameters()), list(head.parameters())
    with deepspeed.zero.GatheredParameters(h_params, modifier_rank=None):
        with deepspeed.zero.GatheredParameters(t_params, modifier_rank=0), torch.no_grad():
            for t, h in zip(t_params, h_params):
                t.mul_(alpha).add_(h.detach(), alpha=1 - alpha)


def _train(case, engines, start, stop):
    for step in range(start, stop):
        x, y = _batch(step)
        _loss(engines, x, y).backward()
        engines["body"].step()
        engines["head"].step()
        _update_teacher(engines["teacher"].module, engines["head"].module, step, CASES[case][5])


def _state(engines_or_modules):
    """Every model's parameters (gathered) and this rank's buffers."""
    out = {}
    for name, m in engines_or_modules.items():
        module = getattr(m, "module", m)
        out[name] = full_params(m)
        out[name].update({f"<buffer {k}>": b.detach().clone() for k, b in module.named_buffers()})
    return out


def _compare(got, want, what, tol=None):
    for name in want:
        for k, w in want[name].items():
            g = got[name][k]
            same = torch.equal(g, w) if tol is None else (g.float() - w.float()).abs().max().item() <= tol
            if not same:
                err = (g.float() - w.float()).abs().max().item()
                raise AssertionError(f"{what}: {name} {k} differs by {err:.3e} on rank {dist.get_rank()} "
                                     f"({'bit-identical' if tol is None else f'tolerance {tol}'} wanted)")


def _ddp(case):
    """The same program under DDP: trained models wrapped, frozen ones plain on every rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    m = _modules(case, seed=0)
    wrapped = {n: DDP(m[n]) if n in ("body", "head") else m[n] for n in m}
    opts = [torch.optim.Adam(m[n].parameters(), lr=1e-2) for n in ("body", "head")]
    for step in range(TOTAL):
        x, y = _batch(step)
        _loss(wrapped, x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        _update_teacher(m["teacher"], m["head"], step, CASES[case][5])
    return _state(m)


def resume_cases(root, cases):
    """Each case: uninterrupted (saved at SAVE_AT) vs DDP, then a resume from other weights vs uninterrupted."""
    for case in cases:
        engines = _build(case, seed=0)
        _train(case, engines, 0, SAVE_AT)
        deepspeed_multi.save_checkpoint(os.path.join(root, case), engines, client_state={"step": SAVE_AT})
        _train(case, engines, SAVE_AT, TOTAL)
        uninterrupted = _state(engines)
        for e in engines.values():
            e.destroy()
        _compare(uninterrupted, _ddp(case), f"{case}: uninterrupted vs DDP", tol=FP32_TOL)

        engines = _build(case, seed=50)  # every model from other weights, the frozen ones too
        start = deepspeed_multi.load_checkpoint(os.path.join(root, case), engines)["step"]
        _train(case, engines, start, TOTAL)
        _compare(_state(engines), uninterrupted, f"{case}: resumed at step {SAVE_AT} vs uninterrupted")
        for e in engines.values():
            e.destroy()


def disk_cost(root):
    """What a frozen engine costs a save: an unchanged one writes no object, a changed one one object
    per distinct rank state (ZeRO-3: one per rank); removing a tag keeps the objects another tag
    references. Returns (bytes written per save, unchanged and changed) on rank 0."""
    from deepspeed_multi.checkpoint import remove_checkpoint
    case = "ema_z3_teacher_bn_train_z0"
    engines = _build(case, seed=0)
    save_dir = os.path.join(root, "cost")
    store = os.path.join(save_dir, ".frozen")

    def objects():
        return sorted(os.listdir(store)) if os.path.isdir(store) else []

    deepspeed_multi.save_checkpoint(save_dir, engines, tag="t0")
    first = objects()
    deepspeed_multi.save_checkpoint(save_dir, engines, tag="t1")  # nothing changed
    unchanged = objects()
    _train(case, engines, 0, 1)  # the teacher (ZeRO-3, 2 ranks) and the prior's buffers change
    deepspeed_multi.save_checkpoint(save_dir, engines, tag="t2")
    changed = objects()
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        # t0: the prior (one full object: the ranks hold the same weights) + the teacher (one per rank)
        assert len(first) == 1 + world, first
        assert unchanged == first, (first, unchanged)
        assert len(changed) == len(first) + world, (first, changed)  # the teacher's new partitions only
        removed = remove_checkpoint(save_dir, "t0")
        assert objects() == changed, "t1 still references every object of t0"
        removed = remove_checkpoint(save_dir, "t1")
        left = objects()
        assert len(left) == 1 + world and set(left) < set(changed), (removed, left)
    dist.barrier()
    resumed = _build(case, seed=50)
    deepspeed_multi.load_checkpoint(save_dir, resumed)  # t2, the one left
    _compare(_state(resumed), _state(engines), "the tag left after removing the others")
    for e in list(engines.values()) + list(resumed.values()):
        e.destroy()
