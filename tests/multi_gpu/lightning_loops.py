"""Fabric programs written as for DDP, run unchanged under Lightning's DDP strategy (the reference)
and under deepspeed_multi.lightning.MultiDeepSpeedStrategy; only the strategy differs.

Each program returns what the comparison needs: every rank's losses (each rank sees its own
batches, so the two runs must agree rank by rank), the gradient norms clip_gradients returned, and
the full final weights of the trained models.
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import FP32_TOL, full_params

LR = 0.05


def zero(stage, clip=0.0, **extra):
    """A model's own config: its ZeRO stage (small buckets, so the tiny models use several)."""
    zo = {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64}
    if stage == 3:
        zo.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=64)
    cfg = {"zero_optimization": zo, **extra}
    if clip:
        cfg["gradient_clipping"] = clip
    return cfg


BASE = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2}}


# ----------------------------------------------------------------------------- models
class Generator(nn.Module):
    def __init__(self, z=4, h=8, out=6):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, out), nn.Tanh())

    def forward(self, noise):
        return self.main(noise)


class Discriminator(nn.Module):
    def __init__(self, inp=6, h=8):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(inp, h), nn.LeakyReLU(0.2), nn.Linear(h, h), nn.LeakyReLU(0.2),
                                  nn.Linear(h, 1))

    def forward(self, x):
        return self.main(x).view(-1)


class Student(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, d))

    def forward(self, x):
        return self.net(x)


class Teacher(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, d))

    def forward(self, x):
        return self.net(x)


class TextEncoder(nn.Module):
    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)

    def forward(self, tokens):
        return self.proj(self.emb(tokens).mean(dim=1))


class VAE(nn.Module):
    def __init__(self, img=10, latent=5):
        super().__init__()
        self.enc = nn.Linear(img, latent)

    def forward(self, image):
        return torch.tanh(self.enc(image))


class UNet(nn.Module):
    def __init__(self, latent=5, cond=6, h=12):
        super().__init__()
        self.inp = nn.Linear(latent + cond, h)
        self.mid = nn.Linear(h, h)
        self.out = nn.Linear(h, latent)

    def forward(self, latent, cond):
        h = F.silu(self.inp(torch.cat([latent, cond], dim=1)))
        return self.out(F.silu(self.mid(h)) + h)


# ----------------------------------------------------------------------------- data
def _gen(step, rank, salt):
    return torch.Generator().manual_seed(100_003 * salt + 1000 * step + rank)


def real_batch(step, rank, n=4):
    return torch.randn(n, 6, generator=_gen(step, rank, 1)).tanh()


def x_batch(step, rank, n=4):
    return torch.randn(n, 8, generator=_gen(step, rank, 2))


def t2i_batch(step, rank, n=4):
    g = _gen(step, rank, 3)
    return torch.randint(0, 11, (n, 3), generator=g), torch.randn(n, 10, generator=g), torch.randn(n, 5, generator=g)


def trained_weights(models: dict) -> dict:
    """Name -> full weights of each model (DDP module or engine; ZeRO-3 partitions gathered)."""
    out = {}
    for name, m in models.items():
        inner = getattr(m, "_forward_module", m)   # _FabricModule -> engine / DDP
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            inner = inner.module
        out[name] = full_params(inner)
    return out


# ----------------------------------------------------------------------------- programs
def gan_setup(fabric, seed=0):
    torch.manual_seed(seed)
    g, d = Generator(), Discriminator()
    opt_g = torch.optim.Adam(g.parameters(), lr=LR, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=LR, betas=(0.5, 0.999))
    g, opt_g = fabric.setup(g, opt_g)
    d, opt_d = fabric.setup(d, opt_d)
    return {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d}


def gan_steps(fabric, s, start, stop, clip=None, out=None, module_zero_grad=False):
    """Lightning's DCGAN loop: D on real and fake (two backward passes), then G through D."""
    out = out if out is not None else {"losses": [], "norms": []}
    g, d, opt_g, opt_d = s["g"], s["d"], s["opt_g"], s["opt_d"]
    for step in range(start, stop):
        real = real_batch(step, fabric.global_rank)
        noise = torch.randn(real.shape[0], 4)            # the global RNG: restored by fabric.load
        (d.zero_grad if module_zero_grad else opt_d.zero_grad)()
        err_real = F.binary_cross_entropy_with_logits(d(real), torch.ones(real.shape[0]))
        fabric.backward(err_real)
        fake = g(noise)
        err_fake = F.binary_cross_entropy_with_logits(d(fake.detach()), torch.zeros(real.shape[0]))
        fabric.backward(err_fake)
        if clip:
            out["norms"].append(float(fabric.clip_gradients(d, opt_d, max_norm=clip)))
        opt_d.step()
        (g.zero_grad if module_zero_grad else opt_g.zero_grad)()
        err_g = F.binary_cross_entropy_with_logits(d(fake), torch.ones(real.shape[0]))
        fabric.backward(err_g)                           # reaches G through D: D's gradients are dropped above
        if clip:
            out["norms"].append(float(fabric.clip_gradients(g, opt_g, max_norm=clip)))
        opt_g.step()
        out["losses"] += [float(err_real), float(err_fake), float(err_g)]
        s["step"] = step + 1
    return out


def gan(fabric, steps=3, clip=None, module_zero_grad=False):
    s = gan_setup(fabric)
    out = gan_steps(fabric, s, 0, steps, clip=clip, module_zero_grad=module_zero_grad)
    out["weights"] = trained_weights({"g": s["g"], "d": s["d"]})
    return out


def distillation(fabric, steps=3, plain_backward=False, teacher_init=None):
    """``teacher_init(fabric)``: the context the teacher is built in (MultiDeepSpeedStrategy's
    init_module("Teacher") partitions it at construction)."""
    torch.manual_seed(1)
    student = Student()
    with teacher_init(fabric) if teacher_init else contextlib.nullcontext():
        teacher = Teacher()
    partitioned = all(hasattr(p, "ds_id") for p in teacher.parameters())
    opt = torch.optim.SGD(student.parameters(), lr=LR, momentum=0.9)
    student, opt = fabric.setup(student, opt)
    teacher = fabric.setup(teacher)                      # frozen: no optimizer
    out = {"losses": [], "norms": []}
    for step in range(steps):
        x = x_batch(step, fabric.global_rank)
        with torch.no_grad():
            target = teacher(x)
        loss = F.mse_loss(student(x), target)
        if plain_backward:
            loss.backward()
        else:
            fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss))
    out["weights"] = trained_weights({"student": student})
    out["partitioned_at_construction"] = partitioned
    return out


def text_to_image(fabric, micro_steps=6, accumulate=2):
    """A trained UNet-like model on a frozen text encoder and VAE, gradient accumulation as in
    Fabric's docs: no_backward_sync around the micro-batches that do not end a window."""
    torch.manual_seed(2)
    text_encoder, vae, unet = TextEncoder(), VAE(), UNet()
    text_encoder = fabric.setup(text_encoder)
    vae = fabric.setup(vae)
    opt = torch.optim.AdamW(unet.parameters(), lr=LR, weight_decay=0.01)
    unet, opt = fabric.setup(unet, opt)
    out = {"losses": [], "norms": []}
    for i in range(micro_steps):
        tokens, image, noise = t2i_batch(i, fabric.global_rank)
        accumulating = (i + 1) % accumulate != 0
        with fabric.no_backward_sync(unet, enabled=accumulating):
            with torch.no_grad():
                cond, latent = text_encoder(tokens), vae(image)
            loss = F.mse_loss(unet(latent + noise, cond), noise)
            fabric.backward(loss / accumulate)
        if not accumulating:
            opt.step()
            opt.zero_grad()
        out["losses"].append(float(loss))
    out["weights"] = trained_weights({"unet": unet})
    return out


def compare(ours: dict, ref: dict, what: str, tol=FP32_TOL):
    for key in ("losses", "norms"):
        a, b = torch.tensor(ours[key]), torch.tensor(ref[key])
        assert a.shape == b.shape, f"{what}: {key} {a.shape} vs DDP {b.shape}"
        if a.numel():
            err = (a - b).abs().max().item()
            assert err <= tol, f"{what}: {key} differ from DDP by {err:.3g}: {a.tolist()} vs {b.tolist()}"
    for model, weights in ref["weights"].items():
        for name, w in weights.items():
            err = (ours["weights"][model][name] - w).abs().max().item()
            assert err <= tol, f"{what}: {model}.{name} differs from DDP by {err:.3g}"
