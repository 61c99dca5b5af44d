"""A LightningModule GAN with manual optimization, as Lightning's GAN examples are written, run by
the Trainer under DDP (the reference) and under MultiDeepSpeedTrainerStrategy."""
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import WORLD_SIZE
from lightning_loops import LR, Discriminator, Generator, Student, Teacher, _gen, real_batch, x_batch


class GAN(pl.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(seed)
        self.generator, self.discriminator = Generator(), Discriminator()
        self.losses = []
        self.seen = set()   # (attribute, class, ZeRO stage) of the models training_step ran

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), lr=LR, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=LR, betas=(0.5, 0.999))]

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        for name in ("generator", "discriminator"):
            m = getattr(self, name)
            self.seen.add((name, type(m).__name__, m.zero_optimization_stage() if hasattr(m, "zero_optimization_stage")
                           else None))
        step = int(batch[0])
        real = real_batch(step, self.global_rank)
        noise = torch.randn(real.shape[0], 4, generator=_gen(step, self.global_rank, 9))
        ones, zeros = torch.ones(real.shape[0]), torch.zeros(real.shape[0])
        opt_d.zero_grad()
        err_real = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        self.manual_backward(err_real)
        fake = self.generator(noise)
        err_fake = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        self.manual_backward(err_fake)
        opt_d.step()
        opt_g.zero_grad()
        err_g = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(err_g)            # reaches the generator through the discriminator
        opt_g.step()
        opt_d.zero_grad()                      # the discriminator's gradients from err_g are not used
        self.losses += [float(err_real), float(err_fake), float(err_g)]


def data(steps_per_epoch):
    return DataLoader(TensorDataset(torch.arange(steps_per_epoch * WORLD_SIZE)), batch_size=1)


def fit(strategy, epochs, module=None, ckpt_path=None, callbacks=()):
    module = module or GAN()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD_SIZE, max_epochs=epochs, logger=False,
                         enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, data(2), ckpt_path=ckpt_path)
    return module, trainer


def weights(module):
    return {name: {n: p.detach().clone() for n, p in getattr(module, name).named_parameters()}
            for name in ("generator", "discriminator")}


class Distillation(pl.LightningModule):
    """A trained student and a frozen teacher attribute (no optimizer: its own engine at its own stage)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(1)
        self.student, self.teacher = Student(), Teacher()
        self.losses, self.seen = [], set()

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=LR, momentum=0.9)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.seen |= {(n, type(getattr(self, n)).__name__) for n in ("student", "teacher")}
        x = x_batch(int(batch[0]), self.global_rank)
        with torch.no_grad():
            target = self.teacher(x)
        loss = F.mse_loss(self.student(x), target)
        self.manual_backward(loss)
        opt.step()
        self.zero_grad()                       # the module's zero_grad, as LightningModules often do
        self.losses.append(float(loss))


class EmaDistillation(Distillation):
    """Distillation whose frozen teacher changes in place after every step, as an EMA teacher does
    (here it decays: the student has another shape), at ZeRO-3 gathered with rank 0's change
    broadcast; ``seed`` builds both models from other weights."""

    def __init__(self, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.student, self.teacher = Student(), Teacher()
        self.final = None

    def training_step(self, batch, batch_idx):
        from common import scale_in_place
        super().training_step(batch, batch_idx)
        scale_in_place(self.teacher, 0.9)

    def on_train_end(self):
        from common import full_params
        self.final = {name: full_params(getattr(self, name)) for name in ("student", "teacher")}


class Automatic(GAN):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = True


class OneOptimizer(GAN):
    def configure_optimizers(self):
        return torch.optim.Adam(list(self.generator.parameters()) + list(self.discriminator.parameters()))
