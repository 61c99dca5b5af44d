"""Knowledge distillation: a ZeRO-2 student learns from a frozen ZeRO-3 teacher.

    torchrun --standalone --nproc_per_node=2 examples/distillation.py [--steps 60] [--bf16]

* The teacher is built inside ``deepspeed_multi.zero_init(teacher_config)``: its parameters are
  partitioned across ranks as they are created (ZeRO-3), and its engine has no optimizer.
* The student is an ordinary module in a ZeRO-2 engine with its own config.
* Per step: the teacher's forward runs under ``torch.no_grad()``, the loss mixes the KL to the
  teacher's distribution with the cross-entropy on the labels, and a plain ``loss.backward()``
  replaces ``student.backward(loss)``.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import _util

D, VOCAB, SEQ, MICRO_BS = 64, 128, 16, 8


class LM(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(*[_util.Block(D) for _ in range(layers)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens):
        return self.head(self.blocks(self.emb(tokens))).float()


def batch(step, rank, dev):
    """Sequences that count upwards mod VOCAB from a random start: an easy next-token task."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    start = torch.randint(0, VOCAB, (MICRO_BS, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].to(dev), seq[:, 1:].to(dev)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    dev, rank, world = _util.setup()
    import deepspeed_multi
    dtype = "bf16" if args.bf16 else "fp32"

    teacher_cfg = _util.ds_config(3, MICRO_BS, dtype=dtype)
    with deepspeed_multi.zero_init(teacher_cfg):          # partitioned at construction
        teacher = LM(layers=3)
    teacher.requires_grad_(False)
    teacher_engine, *_ = deepspeed_multi.initialize(model=teacher, config=teacher_cfg)

    student = LM(layers=1)
    student_cfg = _util.ds_config(2, MICRO_BS, dtype=dtype)
    student_engine, *_ = deepspeed_multi.initialize(
        model=student, optimizer=torch.optim.AdamW(student.parameters(), lr=3e-3), config=student_cfg)
    _util.rank0_print(f"teacher: ZeRO-3 frozen ({sum(p.ds_numel for p in teacher.parameters()) / 1e3:.0f}K params, "
                      f"partitioned), student: ZeRO-2 trained, {dtype}, world size {world}")

    first = last = None
    for step in _util.progress(args.steps, "distill"):
        tokens, labels = batch(step, rank, dev)
        with torch.no_grad():
            t_logits = teacher_engine(tokens)
        s_logits = student_engine(tokens)
        kd = F.kl_div(F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                      reduction="batchmean") / SEQ
        ce = F.cross_entropy(s_logits.flatten(0, 1), labels.flatten())
        loss = 0.7 * kd + 0.3 * ce      # (a random teacher here; in practice a trained one)
        loss.backward()                 # no student_engine.backward(loss) needed
        student_engine.step()
        kd_mean, ce_mean, l_mean = (_util.all_mean(v.item()) for v in (kd, ce, loss))
        first = first or (kd_mean, ce_mean, l_mean)
        last = (kd_mean, ce_mean, l_mean)
        if step % 20 == 0 or step == args.steps - 1:
            _util.rank0_print(f"\nstep {step:3d}: KL(teacher||student) {kd_mean:.4f}  CE {ce_mean:.4f}")
    _util.rank0_print(f"loss {first[2]:.4f} -> {last[2]:.4f} (KL {first[0]:.4f} -> {last[0]:.4f}, "
                      f"CE {first[1]:.4f} -> {last[1]:.4f})")
    if not last[2] < first[2]:
        raise SystemExit("the student did not learn")


if __name__ == "__main__":
    main()
