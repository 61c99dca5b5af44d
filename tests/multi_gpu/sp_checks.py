"""Rank functions of test_sequence_parallel.py: Ulysses sequence parallelism (DeepSpeed's ALST)
against the full sequence in plain PyTorch.

Every rank of a sequence-parallel group holds one slice of each sequence of its data-parallel
replica's batch (``UlyssesSPDataLoaderAdapter``'s sharding, done here by hand: the same slices),
runs a tiny Llama whose attention DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers``
turned into Ulysses attention, and computes the loss of ALST's tutorial (and of the Trainer's
``deepspeed_sp_compute_loss``): each slice's mean cross entropy, all-gathered differentiably over
the group and weighted by its tokens, i.e. the mean over the whole sequence on every rank of the
group. The reference is the same model in plain PyTorch over each replica's full sequences
(DeepSpeed's own attention function), the mean over the replicas, plain SGD.

One call runs every case on the same ranks (one registration: it replaces the process-wide
``sdpa`` attention function and builds DeepSpeed's sequence-parallel groups, both undone at the
end, so the pooled ranks serve the other tests unchanged). Each case returns per rank
``{"err": max abs parameter error, "ratio": |engine update| / |reference update|}``, or
``{"refused": message}``.
"""
import copy
import time
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist
import deepspeed_multi
from common import MLP, ds_config, full_params
from hf_models import HIDDEN, VOCAB, causal_lm, tokens

BATCH, LENGTH, STEPS, LR, D_IN = 2, 8, 3, 0.1, 8


# ------------------------------------------------------------------ data
def replica_batch(step, replica):
    """One data-parallel replica's full batch: token ids, features for an encoder, labels with
    prompt tokens masked (-100) so that the slices hold different numbers of tokens."""
    g = torch.Generator().manual_seed(100 * step + replica)
    ids = tokens(g, BATCH, LENGTH)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, :1 + step % 2] = -100
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    feats = torch.randn(BATCH, LENGTH, D_IN, generator=g)
    pos = torch.arange(LENGTH).expand(BATCH, LENGTH).contiguous()
    return {"ids": ids, "feats": feats, "shift": shift, "pos": pos}


def local_slice(batch, sp_rank, sp):
    chunk = LENGTH // sp
    return {k: v[:, sp_rank * chunk:(sp_rank + 1) * chunk] for k, v in batch.items()}


def sp_loss(logits, shift, sp_group):
    """ALST's loss: the slice's mean, all-gathered with its token count, weighted by it."""
    return sp_weighted(F.cross_entropy(logits.reshape(-1, VOCAB).float(), shift.reshape(-1), ignore_index=-100),
                       shift, sp_group)


class _AllGather(torch.autograd.Function):
    """``torch.distributed.nn.functional.all_gather`` (the tutorial's): its backward sums every
    rank's incoming gradients and keeps this rank's. Torch's own backward on gloo scatters from
    group ranks given as global ranks and fails on an SP group that does not hold rank 0 (4 ranks)."""

    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        summed = torch.stack(grads)
        dist.all_reduce(summed, group=ctx.group)
        return None, summed[dist.get_rank(group=ctx.group)]


def sp_weighted(loss, shift, sp_group):
    losses = _AllGather.apply(sp_group, loss)
    good = (shift != -100).sum()
    goods = _AllGather.apply(sp_group, good)
    total = sum(l * g for l, g in zip(losses, goods) if g > 0)
    return total / max(sum(goods), 1)


def full_loss(logits, shift):
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), shift.reshape(-1), ignore_index=-100)


# ------------------------------------------------------------------ models
def tiled_mlp(model, shards=2):
    """Each LlamaMLP of ``model`` (this instance only) through DeepSpeed's TiledMLP."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, shards, params)

    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)
    return model


def build(case):
    torch.manual_seed(0)
    llm = causal_lm(attn_implementation="sdpa")
    enc = MLP(D_IN, 16, HIDDEN, seed=3) if case.get("encoder") is not None else None
    return enc, llm


def sgd(module):
    return torch.optim.SGD(module.parameters(), lr=LR)


def reference(case, enc, llm, dp, saved_sdpa):
    """Plain PyTorch over each replica's full sequences (DeepSpeed's attention function restored)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    modules = [m for m in (enc, llm) if m is not None]
    opts = [sgd(m) for m in modules]
    ulysses_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = saved_sdpa
    try:
        for step in range(case.get("steps", STEPS)):
            loss = 0
            for replica in range(dp):
                b = replica_batch(step, replica)
                if enc is not None:
                    logits = llm(inputs_embeds=enc(b["feats"]), position_ids=b["pos"]).logits
                else:
                    logits = llm(input_ids=b["ids"], position_ids=b["pos"]).logits
                loss = loss + full_loss(logits, b["shift"]) / dp
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses_sdpa
    return {"enc": full_params(enc) if enc is not None else None, "llm": full_params(llm)}


def engines(case, enc, llm, mpu, upstream):
    init = deepspeed.initialize if upstream else deepspeed_multi.initialize
    built = {}
    if enc is not None:  # the encoder first: it takes the same mpu
        built["enc"], *_ = init(model=enc, optimizer=sgd(enc), config=ds_config(case["encoder"], micro_bs=BATCH),
                                mpu=mpu)
    config = ds_config(case["stage"], micro_bs=BATCH, zero_optimization=case.get("zero", {}))
    built["llm"], *_ = init(model=llm, optimizer=sgd(llm), config=config, mpu=mpu)
    return built


def train(case, built, sp, sp_rank, replica, sp_group, upstream):
    enc, llm = built.get("enc"), built["llm"]
    for step in range(case.get("steps", STEPS)):
        b = local_slice(replica_batch(step, replica), sp_rank, sp)
        if case.get("tiled_loss"):
            loss = tiled_loss(llm, b, sp_group)
            if isinstance(loss, str):
                return loss  # refused
        elif enc is not None:
            loss = sp_loss(llm(inputs_embeds=enc(b["feats"]), position_ids=b["pos"]).logits, b["shift"], sp_group)
        else:
            loss = sp_loss(llm(input_ids=b["ids"], position_ids=b["pos"]).logits, b["shift"], sp_group)
        if upstream:  # one engine: DeepSpeed's own backward (several: upstream's loss.backward())
            llm.backward(loss) if enc is None else loss.backward()
        else:
            loss.backward()
        for e in built.values():
            e.step()
    return None


def tiled_loss(llm, b, sp_group):
    """DeepSpeed's TiledFusedLogitsLoss over the hidden states, ALST-weighted as above; the
    refusal's message where it is refused."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    module = llm.module

    def loss_fn(self, x, y):
        return F.cross_entropy(self.lm_head(x).reshape(-1, VOCAB).float(), y.reshape(-1), ignore_index=-100,
                               reduction="sum")

    hidden = module.model(input_ids=b["ids"], position_ids=b["pos"]).last_hidden_state
    try:
        total = TiledFusedLogitsLoss.apply(loss_fn, module, hidden, b["shift"], None, 2, [module.lm_head.weight],
                                           "sum")
    except RuntimeError as e:
        if "TiledFusedLogitsLoss" not in str(e):
            raise
        return str(e)
    return sp_weighted(total / max((b["shift"] != -100).sum(), 1), b["shift"], sp_group)


def measure(built, ref, initial):
    err, du, dr = 0.0, [], []
    for name, engine in built.items():
        got = full_params(engine)
        for n, want in ref[name].items():
            err = max(err, (got[n] - want).abs().max().item())
            du.append((got[n] - initial[name][n]).flatten())
            dr.append((want - initial[name][n]).flatten())
    return {"err": err, "ratio": (torch.cat(du).norm() / torch.cat(dr).norm()).item()}


# ------------------------------------------------------------------ the rank function
@contextmanager
def undone():
    """Whatever a registration inside the block makes process-wide (the ``sdpa`` attention function,
    DeepSpeed's sequence-parallel groups, its mpu), undone at the end; yields the saved ``sdpa``."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    saved_sdpa, saved_mpu = ALL_ATTENTION_FUNCTIONS["sdpa"], groups.mpu
    try:
        yield saved_sdpa
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = saved_sdpa
        groups.mpu = saved_mpu
        if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
            parallel_state_sp._release_sequence_parallel_groups()


@contextmanager
def ulysses(model, sp):
    """DeepSpeed's registration, undone at the end."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    with undone() as saved_sdpa:
        yield UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=sp,
                                                              micro_batch_size=BATCH, seq_length=LENGTH,
                                                              seq_length_is_variable=False), saved_sdpa


def run_cases(cases, sp):
    """Every case of ``cases`` ({name: case}) on these ranks at sequence_parallel_size ``sp``.

    A case: ``stage`` (the Llama's ZeRO stage), ``encoder`` (None, or the ZeRO stage of an MLP
    feeding the Llama's inputs_embeds), ``zero`` (more of the Llama's ``zero_optimization``),
    ``tiled_mlp``, ``tiled_loss``, ``upstream``
    (``deepspeed.initialize``), ``steps`` (3 unless given)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, sp_rank, replica = world // sp, rank % sp, rank // sp
    out = {}
    with ulysses(build({})[1], sp) as (mpu, saved_sdpa):
        sp_group = mpu.get_sequence_parallel_group()
        for name, case in cases.items():
            start = time.monotonic()
            enc, llm = build(case)
            if case.get("tiled_mlp"):
                tiled_mlp(llm)
            initial = {"llm": full_params(llm), "enc": full_params(enc) if enc is not None else None}
            ref = reference(case, copy.deepcopy(enc), copy.deepcopy(llm), dp, saved_sdpa)
            built = engines(case, enc, llm, mpu, case.get("upstream", False))
            try:
                refused = train(case, built, sp, sp_rank, replica, sp_group, case.get("upstream", False))
                out[name] = {"refused": refused} if refused else measure(built, ref, initial)
            finally:
                for e in built.values():
                    e.destroy()
            out[name]["s"] = round(time.monotonic() - start, 1)
    return out


def untouched_without_sp():
    """Without sequence parallelism the fix installs nothing: DeepSpeed's attribute, its
    ``allreduce_bucket`` and ``TiledFusedLogitsLoss`` stay as they are."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    from deepspeed.utils import groups
    assert groups._get_sequence_parallel_world_size() == 1
    tiled_forward = TiledFusedLogitsLoss.forward
    for stage in (1, 2, 3):
        model = MLP()
        engine, *_ = deepspeed_multi.initialize(model=model, optimizer=sgd(model), config=ds_config(stage))
        opt = engine.optimizer
        assert opt.sequence_parallel_size == 1 and "_dsm_sequence_parallel_size" not in vars(opt), stage
        assert "allreduce_bucket" not in vars(opt).get("_dsm_patches", {}), stage
        engine.destroy()
    assert TiledFusedLogitsLoss.forward is tiled_forward


def zero0_refused(sp):
    """A trained ZeRO-0 engine under sequence parallelism is refused at initialize (its reduction would
    make every update sp times too large, as upstream's does); a frozen ZeRO-0 reference is built."""
    with ulysses(build({})[1], sp) as (mpu, _):
        _, llm = build({"stage": 0})
        try:
            deepspeed_multi.initialize(model=llm, optimizer=sgd(llm), config=ds_config(0, micro_bs=BATCH), mpu=mpu)
        except NotImplementedError as e:
            for text in ("ZeRO stage 0 with sequence parallelism", f"{sp}x the full-sequence", "Use ZeRO stage 1"):
                assert text in str(e), (text, str(e))
        else:
            raise AssertionError("a trained ZeRO-0 engine under sequence parallelism must be refused")
        _, ref = build({"stage": 0})
        ref.requires_grad_(False)
        engine, *_ = deepspeed_multi.initialize(model=ref, config=ds_config(0, micro_bs=BATCH), mpu=mpu)
        engine.destroy()
