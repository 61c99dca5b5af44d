"""Knowledge distillation in Lightning Fabric: the student (ZeRO-2, trained) learns from a frozen
teacher (ZeRO-3, set up without an optimizer, partitioned over the ranks). The loop is written as
for DDP; only the strategy line is deepspeed_multi's.

    torchrun --standalone --nproc_per_node=2 examples/lightning/fabric_distillation.py [--short]
        [--strategy ddp|deepspeed]
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import _common

_common.setup_env()
D, MICRO_BS = 16, 32


def mlp(width, depth):
    layers = [nn.Linear(D, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, D))


class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(128, 3)

    def forward(self, x):
        return self.net(x)


class Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(32, 1)

    def forward(self, x):
        return self.net(x)


def main():
    from lightning.fabric import Fabric
    args = _common.parser(__doc__, steps=200).parse_args()
    steps = 30 if args.short else args.steps
    strategy = _common.strategy(args.strategy, _common.config(2, MICRO_BS),
                                configs={"Teacher": {"zero_optimization": {"stage": 3}}})
    fabric = Fabric(accelerator=_common.accelerator(), devices=_common.devices(), strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    teacher, student = Teacher(), Student()
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    teacher = fabric.setup(teacher)                      # frozen: no optimizer
    student, optimizer = fabric.setup(student, optimizer)
    engines = getattr(fabric.strategy, "engines", [])
    fabric.print("; ".join(f"{type(e.module).__name__} ZeRO-{e.zero_optimization_stage()} "
                           f"({'trained' if e.has_optimizer else 'frozen'})" for e in engines)
                 + f"; world size {fabric.world_size}")
    history = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10_000 * fabric.global_rank + step)
        x = torch.randn(MICRO_BS, D, generator=g).to(fabric.device)
        with torch.no_grad():
            target = teacher(x)
        loss = F.mse_loss(student(x), target)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        history.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    _common.check_falling(fabric.print, "distillation loss", history, args.short)
    _common.end()


if __name__ == "__main__":
    main()
