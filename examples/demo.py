"""deepspeed_multi in one minute: three engines, three ZeRO stages, ONE loss.backward().

    torchrun --standalone --nproc_per_node=2 examples/demo.py

    x -> encoder (ZeRO-2, trained, gas 1) -> middle (ZeRO-3, FROZEN, no optimizer)
      -> head (ZeRO-1, trained, gradient_accumulation_steps 2) -> loss

The same training is replayed in plain PyTorch on one process with the global batch (every
rank's micro-batch, losses averaged over ranks, the head's gradients averaged over its
2-micro-step window) and the parameters are compared at the end. Exit status 0 when they agree.
"""
import copy

import torch

import _util

MICRO_BS, D, STEPS, LR = 4, 16, 8, 0.05
HEAD_GAS = 2


def build_models():
    torch.manual_seed(0)
    return {"encoder": _util.mlp(D, 32, D), "middle": _util.mlp(D, 32, D), "head": _util.mlp(D, 32, 1)}


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(MICRO_BS, D, generator=g)
    return x, x.sum(-1, keepdim=True).sin()   # a target the head can fit


def loss_fn(models, x, y):
    return ((models["head"](models["middle"](models["encoder"](x))) - y)**2).mean()


def reference(world):
    """Plain PyTorch, one process, the global batch: what the engines must reproduce."""
    models = build_models()
    models["middle"].requires_grad_(False)
    opts = {n: torch.optim.SGD(models[n].parameters(), lr=LR) for n in ("encoder", "head")}
    gas = {"encoder": 1, "head": HEAD_GAS}
    for step in range(STEPS):
        for r in range(world):                 # data parallel = mean of the ranks' losses
            x, y = batch(step, r)
            (loss_fn(models, x, y) / world).backward()
        for n, opt in opts.items():
            if (step + 1) % gas[n] == 0:       # end of this model's accumulation window
                for p in models[n].parameters():
                    p.grad.div_(gas[n])
                opt.step()
                opt.zero_grad()
    return models


def main():
    dev, rank, world = _util.setup()
    import deepspeed
    import deepspeed_multi

    models = build_models()
    initial = copy.deepcopy(models)
    cfg = {"encoder": _util.ds_config(2, MICRO_BS), "middle": _util.ds_config(3, MICRO_BS),
           "head": _util.ds_config(1, MICRO_BS, gas=HEAD_GAS)}
    engines = {}
    for name in ("encoder", "middle", "head"):
        model = models[name]
        if name == "middle":                    # frozen: no optimizer, nothing requires grad
            model.requires_grad_(False)
            engines[name], *_ = deepspeed_multi.initialize(model=model, config=cfg[name])
        else:
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            engines[name], *_ = deepspeed_multi.initialize(model=model, optimizer=opt, config=cfg[name])
        _util.rank0_print(f"engine {name:8s}: ZeRO-{cfg[name]['zero_optimization']['stage']}, "
                          f"gas {cfg[name]['gradient_accumulation_steps']}, "
                          f"{'trained' if engines[name].trains else 'frozen'}, {type(engines[name]).__name__}")

    for step in range(STEPS):
        x, y = (t.to(dev) for t in batch(step, rank))
        loss = loss_fn(engines, x, y)
        loss.backward()                         # ONE backward through all three engines
        engines["encoder"].step()
        engines["head"].step()                  # applies the update every HEAD_GAS-th call
        _util.rank0_print(f"step {step}: loss {_util.all_mean(loss.item()):.4f}")

    ref = reference(world)
    worst = 0.0
    for name, engine in engines.items():
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            got = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
        for n, p in ref[name].named_parameters():
            worst = max(worst, (got[n] - p.detach()).abs().max().item())
        moved = max((got[n] - p.detach()).abs().max().item() for n, p in initial[name].named_parameters())
        _util.rank0_print(f"{name:8s}: moved by up to {moved:.3e} from its initial value")
    _util.rank0_print(f"max |engines - plain PyTorch| over all parameters: {worst:.3e}")
    if worst > 1e-5:
        _util.rank0_print("FAIL: the engines do not match plain PyTorch")
        raise SystemExit(1)
    _util.rank0_print("OK: one loss.backward() through ZeRO-2 + frozen ZeRO-3 + ZeRO-1 (gas 2) == plain PyTorch")


if __name__ == "__main__":
    main()
