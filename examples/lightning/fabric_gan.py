"""A DCGAN-style GAN in Lightning Fabric with two DeepSpeed models: the generator at ZeRO-2, the
discriminator at ZeRO-1, each with its own optimizer; the generator's loss runs through the
discriminator. The loop is Fabric's DCGAN example's; only the strategy line is deepspeed_multi's.

    torchrun --standalone --nproc_per_node=2 examples/lightning/fabric_gan.py [--short] [--strategy ddp|deepspeed]
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import _common

_common.setup_env()
Z, IMAGE, MICRO_BS = 8, 16, 16


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(Z, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, IMAGE),
                                  nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(IMAGE, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, x):
        return self.main(x).view(-1)


def real_images(step, rank):
    """'Images' around a fixed pattern, which the generator has to learn."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    pattern = torch.linspace(-0.8, 0.8, IMAGE)
    return torch.tanh(pattern + 0.1 * torch.randn(MICRO_BS, IMAGE, generator=g))


def main():
    from lightning.fabric import Fabric
    args = _common.parser(__doc__, steps=150).parse_args()
    steps = 40 if args.short else args.steps
    strategy = _common.strategy(args.strategy, _common.config(2, MICRO_BS),
                                configs={"Discriminator": {"zero_optimization": {"stage": 1}}})
    fabric = Fabric(accelerator=_common.accelerator(), devices=_common.devices(), strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    generator, discriminator = Generator(), Discriminator()
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    generator, opt_g = fabric.setup(generator, opt_g)
    discriminator, opt_d = fabric.setup(discriminator, opt_d)
    stages = getattr(fabric.strategy, "engines", [])
    fabric.print("; ".join(f"{type(e.module).__name__} ZeRO-{e.zero_optimization_stage()}" for e in stages)
                 + f"; world size {fabric.world_size}")

    ones, zeros = torch.ones(MICRO_BS, device=fabric.device), torch.zeros(MICRO_BS, device=fabric.device)
    history = []
    for step in range(steps):
        real = real_images(step, fabric.global_rank).to(fabric.device)
        noise = torch.randn(MICRO_BS, Z, device=fabric.device)
        # (1) the discriminator: real and fake, two backward passes, one update
        opt_d.zero_grad()
        err_real = F.binary_cross_entropy_with_logits(discriminator(real), ones)
        fabric.backward(err_real)
        fake = generator(noise)
        err_fake = F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros)
        fabric.backward(err_fake)
        opt_d.step()
        # (2) the generator, through the discriminator
        opt_g.zero_grad()
        err_g = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
        fabric.backward(err_g)
        opt_g.step()
        # how far the fakes are from the real pattern: what should fall
        gap = (fake.mean(0) - real.mean(0)).pow(2).mean()
        history.append(fabric.all_reduce(gap.detach(), reduce_op="mean").item())
    _common.check_falling(fabric.print, "fake-vs-real gap", history, args.short)
    _common.end()


if __name__ == "__main__":
    main()
