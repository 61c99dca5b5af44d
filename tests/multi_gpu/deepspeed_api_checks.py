"""Rank functions for test_deepspeed_api.py: DeepSpeed API uses found by running DeepSpeed's own
unit tests through deepspeed_multi.initialize (docs/deepspeed_suite.md), each against plain
PyTorch or against DeepSpeed's own path, without DeepSpeed's test files."""
import os
from unittest import mock

import deepspeed.comm as dist
import torch
from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

import deepspeed_multi
from common import FP32_TOL, MLP, ds_config, expect_error, full_params
from deepspeed_multi import compat


def _batch(step, rank=None):
    """This rank's batch (rank None), or rank ``rank``'s for the reference."""
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _loss(model, step, rank=None):
    x, y = _batch(step, rank)
    return ((model(x) - y)**2).mean()


def _reference_grads(ref, step, gas):
    """Plain PyTorch: every rank's batch of ``step``, averaged over ranks, divided by ``gas``."""
    world = dist.get_world_size()
    for r in range(world):
        (_loss(ref, step, r) / (gas * world)).backward()


def _assert_close(got, ref, what, tol=FP32_TOL):
    want = {n: p.detach().float() for n, p in ref.named_parameters()}
    err = max((got[n] - want[n]).abs().max().item() for n in want)
    assert err <= tol, f"{what}: max abs error {err:.3e}"


class _SGDWithoutSetToNone(torch.optim.SGD):
    """An optimizer whose zero_grad() takes no argument, as DeepSpeed's FusedAdam."""

    def zero_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def zero_grad_without_set_to_none():
    """ZeRO-0 fp32 with an optimizer whose zero_grad() has no set_to_none (zero/buffers.py grads_to_none)."""
    model, ref = MLP(seed=1), MLP(seed=1)
    engine = deepspeed_multi.initialize(model=model, optimizer=_SGDWithoutSetToNone(model.parameters(), lr=0.1),
                                        config=ds_config(0))[0]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        _loss(engine, step).backward()
        engine.step()
        _reference_grads(ref, step, 1)
        opt.step()
        opt.zero_grad()
    _loss(engine, 9).backward()
    engine.zero_grad()  # discards: the next step() changes nothing
    engine.step()
    _assert_close(full_params(engine), ref, "ZeRO-0, zero_grad() without set_to_none")


def requires_grad_off(stage):
    """True -> False after initialize at ZeRO-1/2/3: the parameter gets a zero gradient for the window,
    as PyTorch's Adam with a zero gradient (reliability/misuse.py, [Note: requires_grad turned off
    after initialize]); on again, it trains on."""
    model, ref = MLP(seed=1), MLP(seed=1)
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
                                        config=ds_config(stage))[0]
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step in range(4):
        off = step in (1, 2)
        engine.module.fc1.weight.requires_grad_(not off)
        ref.fc1.weight.requires_grad_(not off)
        _loss(engine, step).backward()
        engine.step()
        _reference_grads(ref, step, 1)
        if off:
            ref.fc1.weight.grad = torch.zeros_like(ref.fc1.weight)
        opt.step()
        opt.zero_grad()
        ref.fc1.weight.requires_grad_(True)
        engine.module.fc1.weight.requires_grad_(True)
    _assert_close(full_params(engine), ref, f"ZeRO-{stage}, requires_grad True -> False -> True")
    engine.destroy()


def set_boundary_updates(stage):
    """set_gradient_accumulation_boundary() decides which step() updates (user_boundary.py); at
    ZeRO-0 the boundary backward's gradients are reduced when it ends, as DeepSpeed's are."""
    model, ref = MLP(seed=1), MLP(seed=1)
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=ds_config(stage, gas=2))[0]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for window in range(2):
        before = full_params(engine)
        for micro in range(2):
            step = 2 * window + micro
            engine.set_gradient_accumulation_boundary(micro == 1)
            engine.backward(_loss(engine, step))
            _reference_grads(ref, step, 2)
            if micro == 1 and stage == 0:  # reduced already: every rank holds the average
                for n, p in engine.module.named_parameters():
                    want = dict(ref.named_parameters())[n].grad
                    assert (p.grad - want).abs().max().item() <= FP32_TOL, f"{n}: not reduced at the boundary"
            if window == 0 or micro == 1:
                engine.step()  # window 0 steps after each backward: the first is a micro-step
            if micro == 0 and window == 0:
                assert all(torch.equal(before[n], v) for n, v in full_params(engine).items()), "micro-step updated"
        opt.step()
        opt.zero_grad()
    _assert_close(full_params(engine), ref, f"ZeRO-{stage}, set_gradient_accumulation_boundary")
    if stage == 0:
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(_loss(engine, 7))
        expect_error(RuntimeError, lambda: engine.backward(_loss(engine, 8)), "before step()",
                     "set_gradient_accumulation_boundary(True)")


def set_boundary_refused_when_user_unmanaged():
    """With managed_gradient_accumulation=false in the config, DeepSpeed's refusal stands."""
    model = MLP(seed=1)
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=ds_config(1, managed_gradient_accumulation=False))[0]
    expect_error(AssertionError, lambda: engine.set_gradient_accumulation_boundary(True),
                 "managed_gradient_accumulation=False")
    engine.destroy()


def set_boundary_bf16_optimizer():
    """bf16 ZeRO-1 with fp32 accumulation (DeepSpeed's BF16_Optimizer): the boundary micro-batch is
    reduced into fp32_groups_gradients_flat when its backward ends, as DeepSpeed does."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    model = MLP(seed=1)
    cfg = ds_config(1, dtype="bf16", gas=2, bf16={"enabled": True, "immediate_grad_update": False},
                    data_types={"grad_accum_dtype": "fp32"})
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=cfg)[0]
    assert isinstance(engine.optimizer, BF16_Optimizer)
    for micro in range(2):
        engine.set_gradient_accumulation_boundary(micro == 1)
        engine.backward(_loss(engine, micro))
    grad = engine.optimizer.fp32_groups_gradients_flat[0].detach().clone()
    gathered = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grad)
    assert all(torch.equal(gathered[0], g) for g in gathered), "the boundary backward did not reduce"
    engine.step()
    params = torch.cat([v.flatten() for v in full_params(engine).values()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    assert all(torch.equal(gathered[0], g) for g in gathered), "ranks updated differently"


def was_step_applied_off_the_boundary(stage):
    """engine.was_step_applied() is False after a step() that only accumulates (it kept the last update's True)."""
    model = MLP(seed=1)
    engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        config=ds_config(stage, gas=2))[0]
    applied = []
    for step in range(4):
        _loss(engine, step).backward()
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True], applied
    engine.destroy()


def _zero3_bf16_engine(cast_on_gather):
    model = MLP(seed=1)
    with mock.patch.dict(os.environ, {"DSM_ZERO3_CAST_ON_GATHER": "1" if cast_on_gather else "0"}):
        engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                            config=ds_config(3, dtype="bf16"))[0]
    assert compat.installed(engine.optimizer, "stage3_cast_on_gather") == cast_on_gather
    return engine


def zero3_partition_assigned():
    """``param.ds_tensor.data = value`` on bf16 ZeRO-3: used by the following forwards until the next
    update, as DeepSpeed's own 16-bit partition (stage3/cast_on_gather.py, _take_assigned)."""
    runs = []
    for cast_on_gather in (False, True):
        engine = _zero3_bf16_engine(cast_on_gather)
        weight = engine.module.fc1.weight
        weight.ds_tensor.data = torch.full_like(weight.ds_tensor.data, 0.25 * (1 + dist.get_rank()))
        outs = []
        for step in range(2):
            loss = _loss(engine, step)
            outs.append(loss.detach())
            loss.backward()
            engine.step()
        outs.append(_loss(engine, 5).detach())
        runs.append((outs, full_params(engine)))
        engine.destroy()
    (ds_outs, ds_params), (outs, params) = runs
    assert all(torch.equal(a, b) for a, b in zip(ds_outs, outs)), (ds_outs, outs)
    assert all(torch.equal(ds_params[n], params[n]) for n in params), "parameters differ from DeepSpeed's layout"


def zero3_offload_local_grads():
    """ZeRO-3 with CPU offload: safe_get_local_grad/safe_set_local_grad between backward and step
    (zero/offload_grads.py, [Note: offloaded ZeRO-3 gradients read between backward and step]):
    the same gradients and the same clipped update as without offload, and as plain PyTorch."""
    results = []
    for offload in (False, True):
        model = MLP(seed=1)
        extra = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False} \
            if offload else {}
        engine = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                            config=ds_config(3, **extra))[0]
        grads = {}
        for step in range(2):
            _loss(engine, step).backward()
            for n, p in engine.module.named_parameters():
                g = safe_get_local_grad(p)
                grads[(step, n)] = g.detach().clone().cpu()
                safe_set_local_grad(p, g * 0.5)
            norm = engine.optimizer._get_norm_groups()
            assert all(float(v) > 0 for v in norm), f"norm of the window's gradients reads {norm}"
            engine.step()
        results.append((grads, full_params(engine)))
    (grads, params), (ograds, oparams) = results
    for key in grads:
        assert torch.equal(grads[key], ograds[key]), f"{key}: offloaded local gradient differs"
        assert grads[key].abs().sum().item() > 0, f"{key}: zero local gradient"
    ref = MLP(seed=1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        _reference_grads(ref, step, 1)
        for p in ref.parameters():
            p.grad *= 0.5
        opt.step()
        opt.zero_grad()
    _assert_close(params, ref, "ZeRO-3 local gradients halved")
    _assert_close(oparams, ref, "ZeRO-3 offload, local gradients halved")


def all_deepspeed_api():
    zero_grad_without_set_to_none()
    for stage in (1, 2, 3):
        requires_grad_off(stage)
    for stage in (0, 1, 2, 3):
        set_boundary_updates(stage)
        was_step_applied_off_the_boundary(stage)
    set_boundary_bf16_optimizer()
    set_boundary_refused_when_user_unmanaged()
    zero3_partition_assigned()
    zero3_offload_local_grads()


# --------------------------------------------------------------- AutoTP and ZeRO-3 leaf modules beside other engines
def _llama_batch(step):
    """The same batch on every rank: the ranks of an AutoTP block are one data-parallel replica."""
    from hf_models import tokens
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(4, 6, 8, generator=g), tokens(g, 4, 6)


def _autotp_full_params(engine):
    """Name -> full copy of every parameter: ZeRO-3 partitions gathered, then AutoTP's shards."""
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    out, module = {}, engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        for prefix, sub in module.named_modules():
            own = list(sub.named_parameters(recurse=False))
            with GatherReplacedLayerParams([p for _, p in own], sub, enabled=bool(own)):
                out.update({(prefix + "." if prefix else "") + n: p.detach().float().clone() for n, p in own})
    return out


def _encoder_into_llama(enc_stage, llm_stage, llm_extra, llm_setup=None, steps=3):
    """An encoder MLP engine feeding a tiny Llama engine through inputs_embeds, one loss.backward() per
    step, against plain PyTorch on the same batch; returns the largest error of either engine."""
    import copy

    from deepspeed.utils import groups
    from hf_models import causal_lm
    torch.manual_seed(0)
    llm, enc = causal_lm(), MLP(d_in=8, d_hidden=32, d_out=16, seed=3)
    ref_llm, ref_enc = copy.deepcopy(llm), copy.deepcopy(enc)
    if llm_setup is not None:
        llm_setup(llm)
    try:
        e_enc = deepspeed_multi.initialize(model=enc, optimizer=torch.optim.SGD(enc.parameters(), lr=0.1),
                                           config=ds_config(enc_stage))[0]
        e_llm = deepspeed_multi.initialize(model=llm, optimizer=torch.optim.SGD(llm.parameters(), lr=0.1),
                                           config=ds_config(llm_stage, **llm_extra))[0]
        opt = torch.optim.SGD(list(ref_llm.parameters()) + list(ref_enc.parameters()), lr=0.1)
        for step in range(steps):
            x, ids = _llama_batch(step)
            e_llm(inputs_embeds=e_enc(x), labels=ids).loss.backward()
            e_enc.step()
            e_llm.step()
            ref_llm(inputs_embeds=ref_enc(x), labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        errs = []
        for got, ref in ((_autotp_full_params(e_llm), ref_llm), (full_params(e_enc), ref_enc)):
            errs += [(got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()]
        return e_enc, e_llm, max(errs)
    finally:
        groups.mpu = None  # an AutoTP engine leaves deepspeed.utils.groups as the process-wide mpu


def autotp_beside_an_engine_without_tp(enc_stage, llm_stage):
    """A ZeRO-2/3 encoder (data-parallel group: both ranks) feeding an AutoTP Llama (autotp_size 2: its
    data-parallel group is the rank alone) with no opt-in: exact ([Note: AutoTP engines beside
    engines without tensor parallelism] in dp_groups.py); the refusal without AutoTP is test_misuse.py's."""
    from deepspeed_multi.reliability import dp_groups
    e_enc, e_llm, err = _encoder_into_llama(enc_stage, llm_stage, {"tensor_parallel": {"autotp_size": 2}})
    assert e_enc._dsm_dp_ranks == (0, 1) and e_llm._dsm_dp_ranks == (dist.get_rank(), ), "not on different groups"
    assert e_llm._dsm_autotp_block == 2 and not dp_groups._DpGroups.mixed
    assert err <= FP32_TOL, f"encoder ZeRO-{enc_stage} -> AutoTP Llama ZeRO-{llm_stage}: max abs error {err:.3e}"
    for e in (e_enc, e_llm):
        e.destroy()


def autotp_keeps_refusing_engines_on_different_groups():
    """Beside an AutoTP engine, a backward through two engines without tensor parallelism on different
    groups (one with an mpu of its own) is still refused; one through the AutoTP engine is exact."""
    from deepspeed.utils import groups
    from misuse_checks import TinyMpu
    rank = dist.get_rank()
    e_enc, e_llm, err = _encoder_into_llama(2, 1, {"tensor_parallel": {"autotp_size": 2}}, steps=1)
    head = MLP(d_in=16, d_hidden=8, d_out=1, seed=4)
    try:
        e_head = deepspeed_multi.initialize(model=head, optimizer=torch.optim.SGD(head.parameters(), lr=0.1),
                                            config=ds_config(2), mpu=TinyMpu([[0, 1]]))[0]
    finally:
        groups.mpu = None
    x, _ = _llama_batch(0)
    expect_error(RuntimeError, lambda: e_head(e_enc(x)).mean().backward(),
                 "one backward pass reaches engines on different data-parallel groups",
                 f"MultiEngine (MLP) averages its gradients over ranks [0, 1], MultiEngine (MLP) over ranks [{rank}]")
    assert err <= FP32_TOL, f"max abs error {err:.3e}"
    for e in (e_enc, e_llm, e_head):
        e.destroy()


def z3_leaf_mlp_beside_an_encoder(enc_stage):
    """ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules) on a Llama's MLP blocks, the Llama fed by
    an encoder engine: exact (docs/limits.md: a LlamaAttention leaf fails, upstream too)."""
    import transformers.models.llama.modeling_llama as llama
    from deepspeed.utils import set_z3_leaf_modules
    e_enc, e_llm, err = _encoder_into_llama(enc_stage, 3, {},
                                            llm_setup=lambda m: set_z3_leaf_modules(m, [llama.LlamaMLP]))
    assert err <= FP32_TOL, f"encoder ZeRO-{enc_stage} -> ZeRO-3 Llama with LlamaMLP leaves: max abs error {err:.3e}"
    for e in (e_enc, e_llm):
        e.destroy()


def all_autotp_and_leaves():
    import time
    times = {}
    for enc_stage in (2, 3):
        for llm_stage in (0, 1, 2, 3):
            start = time.perf_counter()
            autotp_beside_an_engine_without_tp(enc_stage, llm_stage)
            times[f"autotp enc{enc_stage} llm{llm_stage}"] = round(time.perf_counter() - start, 2)
    autotp_keeps_refusing_engines_on_different_groups()
    for enc_stage in (2, 3):
        z3_leaf_mlp_beside_an_encoder(enc_stage)
    return times
