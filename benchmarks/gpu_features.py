"""DeepSpeed's GPU-only training features on one GPU: what upstream does, and that ours refuses by name.

SuperOffload (``offload_optimizer.super_offload``, ZeRO-3) and DeepCompile (``compile.deepcompile``,
ZeRO-1/3) cannot run on a CPU box (SuperOffload asserts a CUDA GPU; DeepCompile's op needs
``cuda.h``). For each, one rank: upstream ``deepspeed.initialize`` + ``engine.backward`` trains a
small MLP for 3 AdamW steps against plain PyTorch AdamW (max abs error), and
``deepspeed_multi.initialize`` must refuse the config naming the feature. Also torch_autocast bf16
and fp16 at ZeRO 1-3, ours (``loss.backward()``) against upstream (``engine.backward``) on the same job:
the max abs difference (0 where CUDA's kernels are deterministic).

Prints ``RESULT gpu_feature_<name>=<text>`` lines. Usage: BENCH_WORLD_SIZE=1 python benchmarks/gpu_features.py
"""
import copy

import _bench as B


def _mlp(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))


def _batches(device, steps=3):
    import torch
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=g).to(device), torch.randn(8, 64, generator=g).to(device))
            for _ in range(steps)]


def _train(initialize, config, ours, steps=3):
    import torch
    model = _mlp()
    engine = initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))[0]
    if (config.get("compile") or {}).get("deepcompile"):
        engine.compile()  # DeepCompile acts from here on (it builds its op: CUDA only)
    for x, y in _batches(engine.device, steps):
        loss = ((engine(x.to(next(engine.parameters()).dtype)).float() - y) ** 2).mean()
        loss.backward() if ours else engine.backward(loss)
        engine.step()
    from deepspeed.utils import safe_get_full_fp32_param
    out = {}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[n] = (full if full is not None else p).detach().float().cpu().clone()
    engine.destroy()
    return out


def _plain(steps=3):
    import torch
    model = _mlp().cuda() if torch.cuda.is_available() else _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for x, y in _batches(next(model.parameters()).device, steps):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def _err(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in b)


def main():
    import deepspeed
    import deepspeed.comm as dist

    import deepspeed_multi
    base = B.ds_config(3, micro_bs=8)
    base["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    features = {
        "super_offload_z3": dict(base, zero_optimization=dict(
            base["zero_optimization"], offload_optimizer={"device": "cpu", "super_offload": True})),
        "deepcompile_z1": dict(base, zero_optimization=dict(base["zero_optimization"], stage=1),
                               compile={"deepcompile": True}),
        "deepcompile_z3": dict(base, compile={"deepcompile": True}),
    }
    plain = _plain()
    for name, config in features.items():
        try:
            up = f"upstream max abs error {_err(_train(deepspeed.initialize, config, False), plain):.2e}"
        except Exception as e:  # what upstream does here is the measurement
            up = f"upstream {type(e).__name__}: {str(e)[:160]}"
        try:
            _train(deepspeed_multi.initialize, config, True)
            ours = "ours RAN (expected a refusal)"
        except NotImplementedError as e:
            ours = "ours refused: " + str(e)[:80]
        print(f"RESULT gpu_feature_{name}={up}; {ours}", flush=True)
    for dtype in ("bfloat16", "float16"):
        for stage in (1, 2, 3):
            config = dict(B.ds_config(stage, micro_bs=8), optimizer=base["optimizer"],
                          torch_autocast={"enabled": True, "dtype": dtype})
            diff = _err(_train(deepspeed_multi.initialize, config, True), _train(deepspeed.initialize, config, False))
            print(f"RESULT gpu_feature_torch_autocast_{dtype}_z{stage}=ours vs upstream max abs {diff:.2e}", flush=True)
    return dist.get_rank()


if __name__ == "__main__":
    B.launch(main, world_size=1, timeout_s=600)
