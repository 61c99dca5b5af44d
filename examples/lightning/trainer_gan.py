"""The GAN of fabric_gan.py as a LightningModule under the PyTorch Lightning Trainer, with manual
optimization as Lightning's GAN examples are written: the generator (ZeRO-2) and the discriminator
(ZeRO-1) are attributes of the module, each its own engine with its own optimizer. Only the
strategy line is deepspeed_multi's.

    torchrun --standalone --nproc_per_node=2 examples/lightning/trainer_gan.py [--short] [--strategy ddp|deepspeed]
"""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import _common
from fabric_gan import MICRO_BS, Z, Discriminator, Generator, real_images

_common.setup_env()


def module_class():
    import lightning.pytorch as pl

    class GAN(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.generator, self.discriminator = Generator(), Discriminator()
            self.history = []

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))]

        def on_train_start(self):
            stage = {n: getattr(getattr(self, n), "zero_optimization_stage", lambda: None)()
                     for n in ("generator", "discriminator")}
            if self.trainer.is_global_zero and None not in stage.values():
                print("; ".join(f"{n} ZeRO-{s}" for n, s in stage.items()) + f"; world size {self.trainer.world_size}")

        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            real = real_images(int(batch[0]), self.global_rank).to(self.device)
            noise = torch.randn(MICRO_BS, Z, device=self.device)
            ones, zeros = torch.ones(MICRO_BS, device=self.device), torch.zeros(MICRO_BS, device=self.device)
            opt_d.zero_grad()
            self.manual_backward(F.binary_cross_entropy_with_logits(self.discriminator(real), ones))
            fake = self.generator(noise)
            self.manual_backward(F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros))
            opt_d.step()
            opt_g.zero_grad()
            self.manual_backward(F.binary_cross_entropy_with_logits(self.discriminator(fake), ones))
            opt_g.step()
            opt_d.zero_grad()   # the discriminator's gradients from the generator's loss are not used
            gap = (fake.mean(0) - real.mean(0)).pow(2).mean().detach()
            self.history.append(self.trainer.strategy.reduce(gap, reduce_op="mean").item())

    return GAN


def main():
    import lightning.pytorch as pl
    args = _common.parser(__doc__, steps=150).parse_args()
    steps = 40 if args.short else args.steps
    torch.manual_seed(0)
    module = module_class()()
    strategy = _common.strategy(args.strategy, _common.config(2, MICRO_BS),
                                configs={"discriminator": {"zero_optimization": {"stage": 1}}}, trainer=True)
    trainer = pl.Trainer(strategy=strategy, accelerator=_common.accelerator(),
                         devices=_common.devices(), max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.arange(steps * _common.devices())), batch_size=1)
    trainer.fit(module, data)
    _common.check_falling(print if trainer.is_global_zero else (lambda *a: None), "fake-vs-real gap",
                          module.history, args.short)
    _common.end()


if __name__ == "__main__":
    main()
