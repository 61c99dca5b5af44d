"""A GAN with two engines: generator at ZeRO-2, discriminator at ZeRO-3, plain backward calls.

    torchrun --standalone --nproc_per_node=2 examples/gan.py [--steps 300]

The data is a Gaussian in 8 dimensions with mean 2 and std 0.5; the generator maps N(0, 1)
noise to it. Each step has the two usual phases:

1. discriminator: ``fake = G(z).detach()``, ``d_loss.backward()``, ``D.step()``;
2. generator: ``g_loss = softplus(-D(G(z))).mean()``, ``g_loss.backward()`` - the gradient flows
   through the ZeRO-3 discriminator engine into the generator - then ``G.step()`` and
   ``D.zero_grad()`` (D's gradients from the generator phase are discarded, as in PyTorch).
"""
import argparse

import torch
import torch.nn.functional as F

import _util

D_NOISE, D_DATA, MICRO_BS = 8, 8, 64
MEAN, STD = 2.0, 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    dev, rank, world = _util.setup()
    import deepspeed_multi

    gen = _util.mlp(D_NOISE, 64, D_DATA)
    disc = _util.mlp(D_DATA, 64, 1)
    G, *_ = deepspeed_multi.initialize(model=gen, optimizer=torch.optim.Adam(gen.parameters(), 2e-3, betas=(0.5, 0.9)),
                                       config=_util.ds_config(2, MICRO_BS))
    D, *_ = deepspeed_multi.initialize(model=disc, optimizer=torch.optim.Adam(disc.parameters(), 2e-3,
                                                                              betas=(0.5, 0.9)),
                                       config=_util.ds_config(3, MICRO_BS))
    _util.rank0_print(f"G: ZeRO-2, D: ZeRO-3 (partitioned over {world} ranks); target N({MEAN}, {STD}^2) in "
                      f"{D_DATA} dims")
    g = torch.Generator().manual_seed(rank)

    def stats():
        with torch.no_grad():
            fake = G(torch.randn(1024, D_NOISE, generator=g).to(dev))
        return _util.all_mean(fake.mean().item()), _util.all_mean(fake.std(0).mean().item())

    m0, s0 = stats()
    _util.rank0_print(f"before: generated mean {m0:.3f}, std {s0:.3f}")
    for step in _util.progress(args.steps, "gan"):
        real = (MEAN + STD * torch.randn(MICRO_BS, D_DATA, generator=g)).to(dev)
        z = torch.randn(MICRO_BS, D_NOISE, generator=g).to(dev)
        # 1. discriminator
        fake = G(z).detach()
        d_loss = F.softplus(-D(real)).mean() + F.softplus(D(fake)).mean()
        d_loss.backward()
        D.step()
        # 2. generator: backward through the (ZeRO-3) discriminator engine into G
        g_loss = F.softplus(-D(G(z))).mean()
        g_loss.backward()
        G.step()
        D.zero_grad()
        if step % 100 == 0:
            _util.rank0_print(f"\nstep {step}: d_loss {_util.all_mean(d_loss.item()):.3f}  "
                              f"g_loss {_util.all_mean(g_loss.item()):.3f}")
    m1, s1 = stats()
    _util.rank0_print(f"after:  generated mean {m1:.3f}, std {s1:.3f} (target {MEAN}, {STD}); "
                      f"|mean error| {abs(m0 - MEAN):.3f} -> {abs(m1 - MEAN):.3f}")
    if not abs(m1 - MEAN) < abs(m0 - MEAN):
        raise SystemExit("the generator did not move towards the data")


if __name__ == "__main__":
    main()
