"""The correctness matrix: every scenario by name, built the same way for tests and reports."""
import functools
import itertools

import torch
import torch.nn.functional as F

from common import MLP, Member, Phase, Scenario, ds_config
from common import default_batch
from models import CheckpointedMLP, EmbBody, InplaceInputMLP, Scalar, StructuredMLP, TwoHeads, structured_out
from models import MoEMLP, lora_llama, moe_param_groups, tiny_causal_lm


def mlp(seed, **kw):
    return functools.partial(MLP, seed=seed, **kw)


def mse(out, y):
    return ((out - y)**2).mean()


def mod(model):
    """The module inside an engine, or the plain module itself (the reference)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    return model.module if isinstance(model, DeepSpeedEngine) else model


def _with_step(batch_fn):

    def batch(step, rank):
        out = batch_fn(step, rank)
        out["step"] = torch.tensor(step)
        return out

    return batch


def _single(stage, dtype="fp32", gas=1):
    return Scenario(members={"a": Member(mlp(1), ds_config(stage, dtype, gas))},
                    phases=[Phase(lambda m, b, c: mse(m["a"](b["x"]), b["y"]))], dtype=dtype)


def _chain(sa, sb, gas_a=1, gas_b=1, dtype_a="fp32", dtype_b="fp32"):
    dtype = "fp32" if dtype_a == dtype_b == "fp32" else "mixed"
    return Scenario(members={"a": Member(mlp(1), ds_config(sa, dtype_a, gas_a)),
                             "b": Member(mlp(2), ds_config(sb, dtype_b, gas_b))},
                    phases=[Phase(lambda m, b, c: mse(m["b"](m["a"](b["x"])), b["y"]))],
                    dtype=dtype, micro_steps=6)


def _frozen_middle(stage_llm=3, head=True, gas=1, dtype="fp32"):
    members = {"proj": Member(mlp(1), ds_config(2, dtype, gas)),
               "llm": Member(mlp(2), ds_config(stage_llm, dtype), trainable=False)}
    if head:
        members["head"] = Member(mlp(3), ds_config(1, dtype, gas))

    def loss(m, b, c):
        h = m["llm"](m["proj"](b["x"]))
        return mse(m["head"](h) if head else h, b["y"])

    return Scenario(members=members, phases=[Phase(loss)], dtype=dtype)


def _distill(dtype="fp32", teacher_stage=3):
    def loss(m, b, c):
        with torch.no_grad():
            t = m["teacher"](b["x"])
        s = m["student"](b["x"])
        return mse(s, b["y"]) + F.kl_div(F.log_softmax(s, -1), F.softmax(t, -1), reduction="batchmean")

    return Scenario(members={"student": Member(mlp(1), ds_config(2, dtype)),
                             "teacher": Member(mlp(2), ds_config(teacher_stage, dtype), trainable=False)},
                    phases=[Phase(loss)], dtype=dtype)


def _rlhf(dtype="fp32"):
    def loss(m, b, c):
        act = m["actor"](b["x"])
        with torch.no_grad():
            ref = m["reference"](b["x"])
        reward = m["reward"](act)            # gradient flows through the frozen ZeRO-3 reward model
        value = m["critic"](b["x"])
        actor_loss = -reward.mean() + 0.1 * ((act - ref)**2).mean()
        critic_loss = ((value - reward.detach())**2).mean()
        return actor_loss + critic_loss

    return Scenario(members={"actor": Member(mlp(1), ds_config(2, dtype)),
                             "critic": Member(functools.partial(Scalar, seed=2), ds_config(3, dtype)),
                             "reference": Member(mlp(3), ds_config(3, dtype), trainable=False),
                             "reward": Member(functools.partial(Scalar, seed=4), ds_config(3, dtype),
                                              trainable=False)},
                    phases=[Phase(loss)], dtype=dtype, world_size=4, micro_steps=3)


def _gan(stage_g=2, stage_d=3, dtype="fp32"):
    def d_loss(m, b, c):
        fake = m["G"](b["x"]).detach()
        return F.softplus(-m["D"](b["y"])).mean() + F.softplus(m["D"](fake)).mean()

    def g_loss(m, b, c):
        return F.softplus(-m["D"](m["G"](b["x"]))).mean()

    return Scenario(members={"G": Member(mlp(1), ds_config(stage_g, dtype)),
                             "D": Member(functools.partial(Scalar, seed=2), ds_config(stage_d, dtype))},
                    phases=[Phase(d_loss, after=(("step", "D"), )),
                            Phase(g_loss, after=(("step", "G"), ("zero_grad", "D")))], dtype=dtype)


def _twice(stage, nested=True):
    def loss(m, b, c):
        a = m["a"]
        out = a(a(b["x"])) if nested else a(b["x"]) + a(b["y"])
        return mse(out, b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage))}, phases=[Phase(loss)])


def _structured(kind, stage=2):
    def loss(m, b, c):
        out, hidden = structured_out(m["b"](m["a"](b["x"])))
        return mse(out, b["y"]) + 0.5 * hidden.pow(2).mean()

    return Scenario(members={"a": Member(mlp(1), ds_config(2)),
                             "b": Member(functools.partial(StructuredMLP, kind=kind, seed=2), ds_config(stage))},
                    phases=[Phase(loss)])


def _twice_retain(stage):
    """E(E(x)), then a second backward pass through the retained graph (the shape of fuzz seed 27)."""

    def first(m, b, c):
        c["out"] = m["a"](m["a"](b["x"]))
        return mse(c["out"], b["y"])

    def second(m, b, c):
        return c["out"].pow(2).mean()

    return Scenario(members={"a": Member(mlp(1), ds_config(stage))},
                    phases=[Phase(first, retain_graph=True, after=()), Phase(second)])


def _frozen_twice(stage):
    """A frozen engine called twice in a row in the gradient path (found by the fuzzer, seed 65)."""

    def loss(m, b, c):
        return mse(m["llm"](m["llm"](m["proj"](b["x"]))), b["y"])

    return Scenario(members={"proj": Member(mlp(1), ds_config(2)),
                             "llm": Member(mlp(2), ds_config(stage), trainable=False)},
                    phases=[Phase(loss)])


def _fuzz_program(seed, profile="fp32"):
    """A program the differential fuzzer (fuzz.py) found failing, kept as a row of its own."""
    import fuzz
    spec = fuzz.draw(seed, profile)
    for engine in spec["engines"]:
        engine["bucket"] = 64  # as when it was found (the fuzzer draws bucket sizes since)
    return fuzz.build(spec)


def _two_backward(stage, retain=False, gas=1):
    if retain:
        def first(m, b, c):
            c["out"] = m["a"](b["x"])
            return mse(c["out"], b["y"])

        def second(m, b, c):
            return c["out"].pow(2).mean()
    else:
        def first(m, b, c):
            return mse(m["a"](b["x"]), b["y"])

        def second(m, b, c):
            return mse(m["a"](2 * b["x"]), b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage, gas=gas))},
                    phases=[Phase(first, retain_graph=retain, after=()), Phase(second)])


def _retain_chain(stage):
    """Two losses from one forward through two engines; the first covers only part of the graph."""

    def first(m, b, c):
        out, hidden = structured_out(m["b"](m["a"](b["x"])))
        c["out"] = out
        return hidden.pow(2).mean()

    def second(m, b, c):
        return mse(c["out"], b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage)),
                             "b": Member(functools.partial(StructuredMLP, kind="dict", seed=2), ds_config(stage))},
                    phases=[Phase(first, retain_graph=True, after=()), Phase(second)])


def _partial_window(stage, gas=2):
    """A head that the first micro-batch of each accumulation window does not use."""

    def loss(m, b, c):
        head = 2 if int(b["step"]) % gas == gas - 1 else 1
        return mse(m["a"](b["x"], head), b["y"])

    def batch(step, rank):
        out = default_batch(step, rank)
        out["step"] = torch.tensor(step)
        return out

    return Scenario(members={"a": Member(functools.partial(TwoHeads, seed=1), ds_config(stage, gas=gas))},
                    phases=[Phase(loss)], batch=batch, micro_steps=6)


def _inplace(stage):
    """Engine b modifies its input (engine a's output) in place; the user modifies b's output in place."""

    def loss(m, b, c):
        out = m["b"](m["a"](b["x"]))
        out.add_(1.0)
        return mse(out, b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage)),
                             "b": Member(functools.partial(InplaceInputMLP, seed=2), ds_config(stage))},
                    phases=[Phase(loss)])


def _zero_grad_discards(stage):
    def first(m, b, c):
        return mse(m["a"](b["x"]), 3 * b["y"])

    def second(m, b, c):
        return mse(m["a"](b["x"]), b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage))},
                    phases=[Phase(first, after=(("zero_grad", "a"), )), Phase(second)])


def _grad_tensors(stage):
    def loss(m, b, c):
        out = m["b"](m["a"](b["x"]))
        return (out, ), (b["y"], )

    return Scenario(members={"a": Member(mlp(1), ds_config(stage)), "b": Member(mlp(2), ds_config(2))},
                    phases=[Phase(loss)])


def _checkpointed(stage, reentrant):
    def loss(m, b, c):
        return mse(m["b"](m["a"](b["x"])), b["y"])

    return Scenario(members={"a": Member(functools.partial(CheckpointedMLP, reentrant=reentrant, seed=1),
                                         ds_config(2)),
                             "b": Member(functools.partial(CheckpointedMLP, reentrant=reentrant, seed=2),
                                         ds_config(stage))},
                    phases=[Phase(loss)])


def _grad_penalty(stage, gas=1):
    """WGAN-GP style: torch.autograd.grad(create_graph=True) inside the loss."""

    def loss(m, b, c):
        x = b["x"].clone().requires_grad_(True)
        d = m["D"](x)
        (gx, ) = torch.autograd.grad(d.sum(), x, create_graph=True)
        return d.mean() + ((gx.norm(dim=-1) - 1)**2).mean()

    return Scenario(members={"D": Member(functools.partial(Scalar, seed=1), ds_config(stage, gas=gas))},
                    phases=[Phase(loss)])


def _grad_penalty_beside_zero3(stage, gas=2):
    """A gradient-penalty discriminator beside a frozen ZeRO-3 feature model (a GAN with a ZeRO-3
    teacher). Building the ZeRO-3 engine replaces torch.nn.functional.linear in the whole process
    with DeepSpeed's memory_efficient_linear Function, which saves the weight itself: the penalty's
    second-order gradient then reaches D's weights from nodes its backward made (the direct-use
    check once took them for a direct use; the gradient is right)."""

    def loss(m, b, c):
        with torch.no_grad():
            h = m["T"](b["x"])
        x = h.clone().requires_grad_(True)
        d = m["D"](x)
        (gx, ) = torch.autograd.grad(d.sum(), x, create_graph=True)
        return d.mean() + ((gx.norm(dim=-1) - 1)**2).mean()

    def took_effect(engines):
        assert torch.nn.functional.linear.__name__ == "zero3_linear_wrap", torch.nn.functional.linear

    return Scenario(members={"T": Member(mlp(5), ds_config(3), trainable=False),
                             "D": Member(functools.partial(Scalar, seed=1), ds_config(stage, gas=gas))},
                    phases=[Phase(loss)], took_effect=took_effect)


def _hooks(stage):
    def loss(m, b, c):
        h = m["a"](b["x"])
        h.register_hook(lambda g: 2 * g)
        return mse(m["b"](h), b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage)), "b": Member(mlp(2), ds_config(stage))},
                    phases=[Phase(loss)])


def _outside_call(stage, dtype="fp32", gas=2, tied=False):
    """A submodule called by the user outside engine(...) (the issue-7 reproduction), optionally
    sharing its weight with a head used inside forward (tied embeddings)."""

    def loss(m, b, c):
        emb = mod(m["a"]).emb
        return mse(m["a"](emb(b["x"].to(emb.weight.dtype))), b["y"])

    return Scenario(members={"a": Member(functools.partial(EmbBody, seed=1, tied=tied), ds_config(stage, dtype, gas))},
                    phases=[Phase(loss)], dtype=dtype)


def _llava_batch(step, rank):
    out = default_batch(step, rank)
    out["ids"] = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(7000 + 1000 * step + rank))
    return out


def _llava(stage, dtype="fp32", gas=2, arch="gpt2"):
    """Seed 001 / LLaVA: image features from a ZeRO-2 encoder are concatenated with the LLM's own
    input embeddings (its embedding module called outside engine(...)), then llm(inputs_embeds=...)."""

    def loss(m, b, c):
        text = mod(m["llm"]).get_input_embeddings()(b["ids"])
        image = m["vision"](b["x"]).to(text.dtype).unsqueeze(1)
        labels = torch.cat([torch.full_like(b["ids"][:, :1], -100), b["ids"]], dim=1)
        return m["llm"](inputs_embeds=torch.cat([image, text], dim=1), labels=labels).loss.float()

    return Scenario(members={"vision": Member(mlp(1, d_out=16), ds_config(2, dtype, gas)),
                             "llm": Member(functools.partial(tiny_causal_lm, arch, seed=2), ds_config(stage, dtype, gas))},
                    phases=[Phase(loss)], batch=_llava_batch, dtype=dtype)


def _step_no_backward(stage):
    """``a`` (gas 2) is used on two micro-steps out of four, so every other window has no backward
    through it; ``c`` is never used; every engine's step() runs on every micro-step."""

    def loss(m, b, c):
        h = m["b"](b["x"])
        if int(b["step"]) % 4 < 2:
            h = m["a"](h)
        return mse(h, b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage, gas=2)), "b": Member(mlp(2), ds_config(2)),
                             "c": Member(mlp(3), ds_config(stage))},
                    phases=[Phase(loss)], batch=_with_step(default_batch), micro_steps=8)


def _grad_inputs_only(stage):
    """torch.autograd.grad of an input only (no parameter gradient), then an ordinary backward."""

    def input_grad(m, b, c):
        x = b["x"].clone().requires_grad_(True)
        torch.autograd.grad(mse(m["b"](m["a"](x)), b["y"]), x)
        return None

    def loss(m, b, c):
        return mse(m["b"](m["a"](b["x"])), b["y"])

    return Scenario(members={"a": Member(mlp(1), ds_config(stage)), "b": Member(mlp(2), ds_config(stage, gas=2))},
                    phases=[Phase(input_grad, after=(("step", "a"), ("step", "b"))), Phase(loss)])


def _direct_param(stage):
    """A parameter used as a tensor outside any module call: must raise, never be silently wrong."""

    def loss(m, b, c):
        import deepspeed
        fc = mod(m["a"]).fc1
        with deepspeed.zero.GatheredParameters([fc.weight, fc.bias]):
            direct = F.linear(b["x"], fc.weight, fc.bias).pow(2).mean()
        return mse(m["b"](b["x"]), b["y"]) + direct

    return Scenario(members={"a": Member(mlp(1), ds_config(stage, gas=2)), "b": Member(mlp(2), ds_config(2))},
                    phases=[Phase(loss)])


def _direct_param_mixed(stage, dtype="fp32", gas=2, check_updates=None):
    """A parameter used both inside the engine and directly as a tensor in the same backward (an
    L2 penalty on one layer's weight written outside forward). The direct term's gradient misses
    the engine's scale: raised while the check runs, unless the scale is 1 (gas 1, no fp16), where
    it is exact. ``check_updates=0`` turns the check off (the update is then silently wrong)."""

    def loss(m, b, c):
        fc = mod(m["a"]).fc1
        return mse(m["a"](b["x"]), b["y"]) + 0.1 * F.linear(b["x"].to(fc.weight.dtype), fc.weight).float().pow(2).mean()

    config = ds_config(stage, dtype, gas=gas)
    if check_updates is not None:
        config["deepspeed_multi"] = {"direct_use_check_updates": check_updates}
    return Scenario(members={"a": Member(mlp(1), config)}, phases=[Phase(loss)], dtype=dtype)


def _with_options(scenario, **options):
    """The same scenario with deepspeed_multi options in every member's config."""
    for member in scenario.members.values():
        member.config["deepspeed_multi"] = dict(options)
    return scenario


def _knobs(scenario, top=None, **zero):
    """The same scenario with DeepSpeed config keys in every member's config: ``top`` at the top
    level, ``zero`` under zero_optimization."""
    for member in scenario.members.values():
        member.config.update(top or {})
        member.config["zero_optimization"].update(zero)
    return scenario


SCENARIOS = {}
for s in range(4):
    SCENARIOS[f"single-z{s}"] = functools.partial(_single, s)
    SCENARIOS[f"single-z{s}-bf16"] = functools.partial(_single, s, "bf16")
    SCENARIOS[f"single-z{s}-fp16"] = functools.partial(_single, s, "fp16")
    SCENARIOS[f"single-z{s}-gas2"] = functools.partial(_single, s, "fp32", 2)
CHAIN_GAS = [(1, 1), (2, 2), (3, 1)]
for sa, sb in itertools.product(range(4), repeat=2):
    for ga, gb in CHAIN_GAS:
        SCENARIOS[f"chain-z{sa}z{sb}-gas{ga}{gb}"] = functools.partial(_chain, sa, sb, ga, gb)
SCENARIOS.update({
    "chain-z2z3-bf16": functools.partial(_chain, 2, 3, dtype_a="bf16", dtype_b="bf16"),
    "chain-z2z3-fp16": functools.partial(_chain, 2, 3, dtype_a="fp16", dtype_b="fp16"),
    "chain-z1z3-fp16-gas2": functools.partial(_chain, 1, 3, 2, 2, dtype_a="fp16", dtype_b="fp16"),
    "chain-z2z3-fp16-into-bf16": functools.partial(_chain, 2, 3, dtype_a="fp16", dtype_b="bf16"),
    "chain-z0z2-fp32-into-fp16": functools.partial(_chain, 0, 2, dtype_a="fp32", dtype_b="fp16"),
    "frozen-z3-middle": functools.partial(_frozen_middle, 3),
    "frozen-z3-last": functools.partial(_frozen_middle, 3, head=False),
    "frozen-z3-middle-gas2": functools.partial(_frozen_middle, 3, gas=2),
    "frozen-z0-middle": functools.partial(_frozen_middle, 0),
    "frozen-z3-middle-bf16": functools.partial(_frozen_middle, 3, dtype="bf16"),
    "distill-z2-z3": _distill,
    "distill-z2-z3-bf16": functools.partial(_distill, "bf16"),
    "rlhf-4-engines": _rlhf,
    "gan-z2-z3": _gan,
    "gan-z1-z2": functools.partial(_gan, 1, 2),
    "gan-z0-z1": functools.partial(_gan, 0, 1),
    "gan-z3-z3-bf16": functools.partial(_gan, 3, 3, "bf16"),
})
for s in range(4):
    SCENARIOS[f"twice-nested-z{s}"] = functools.partial(_twice, s)
    SCENARIOS[f"twice-sum-z{s}"] = functools.partial(_twice, s, False)
    SCENARIOS[f"twice-nested-retain-z{s}"] = functools.partial(_twice_retain, s)
    SCENARIOS[f"two-backward-z{s}"] = functools.partial(_two_backward, s)
    SCENARIOS[f"two-backward-retain-z{s}"] = functools.partial(_two_backward, s, True)
    SCENARIOS[f"zero-grad-discards-z{s}"] = functools.partial(_zero_grad_discards, s)
    SCENARIOS[f"partial-window-z{s}-gas2"] = functools.partial(_partial_window, s)
    SCENARIOS[f"inplace-z{s}"] = functools.partial(_inplace, s)
    SCENARIOS[f"grad-tensors-z{s}"] = functools.partial(_grad_tensors, s)
    SCENARIOS[f"grad-penalty-z{s}"] = functools.partial(_grad_penalty, s)
    SCENARIOS[f"hooks-z{s}"] = functools.partial(_hooks, s)
    for reentrant in (True, False):
        SCENARIOS[f"checkpoint-{'reentrant' if reentrant else 'nonreentrant'}-z{s}"] = functools.partial(
            _checkpointed, s, reentrant)
SCENARIOS["chain-z2z3-skip-group"] = lambda: _with_options(_chain(2, 3, 2, 2), skip_group="chain")
SCENARIOS["chain-z0z1-skip-group"] = lambda: _with_options(_chain(0, 1), skip_group="chain01")
SCENARIOS["two-backward-retain-chain-z3"] = functools.partial(_retain_chain, 3)
SCENARIOS["two-backward-retain-chain-z2"] = functools.partial(_retain_chain, 2)
SCENARIOS["two-backward-z2-gas2"] = functools.partial(_two_backward, 2, gas=2)
SCENARIOS["grad-penalty-z2-gas2"] = functools.partial(_grad_penalty, 2, gas=2)
SCENARIOS["grad-penalty-z2-gas2-beside-zero3"] = functools.partial(_grad_penalty_beside_zero3, 2)
SCENARIOS["grad-penalty-z1-gas2-beside-zero3"] = functools.partial(_grad_penalty_beside_zero3, 1)
for kind in ("dict", "dataclass", "namedtuple", "list"):
    SCENARIOS[f"outputs-{kind}-z3"] = functools.partial(_structured, kind)
# Issue 7: graphs real code makes.
for s in range(4):
    SCENARIOS[f"outside-call-z{s}-gas2"] = functools.partial(_outside_call, s)
    SCENARIOS[f"outside-call-z{s}-fp16-gas2"] = functools.partial(_outside_call, s, "fp16")
    SCENARIOS[f"outside-call-tied-z{s}-gas2"] = functools.partial(_outside_call, s, tied=True)
    SCENARIOS[f"llava-gpt2-z{s}-gas2"] = functools.partial(_llava, s)
    SCENARIOS[f"llava-gpt2-z{s}-fp16-gas2"] = functools.partial(_llava, s, "fp16")
    SCENARIOS[f"step-no-backward-z{s}"] = functools.partial(_step_no_backward, s)
    SCENARIOS[f"grad-inputs-only-z{s}"] = functools.partial(_grad_inputs_only, s)
    SCENARIOS[f"direct-param-z{s}"] = functools.partial(_direct_param, s)
for s in range(3):  # ZeRO-3: torch's shape error first (direct-param-z3)
    SCENARIOS[f"direct-mixed-z{s}-gas2"] = functools.partial(_direct_param_mixed, s)
    SCENARIOS[f"direct-mixed-z{s}-fp16"] = functools.partial(_direct_param_mixed, s, "fp16", 1)
    SCENARIOS[f"direct-mixed-z{s}-gas1"] = functools.partial(_direct_param_mixed, s, gas=1)
# Found by the fuzzer (the seeds replay with `make fuzz SEED=N`): ZeRO-3 dataclass outputs got no
# pre-backward gather (27, 54); a frozen ZeRO-3 engine kept submodules gathered after backward (65).
SCENARIOS["fuzz-27-z3-twice-retain-dataclass"] = functools.partial(_fuzz_program, 27)
SCENARIOS["fuzz-54-z3-dataclass-outside-call"] = functools.partial(_fuzz_program, 54)
SCENARIOS["fuzz-65-z3-frozen-twice-dataclass"] = functools.partial(_fuzz_program, 65)
# ZeRO-3 leaves a prefetch in flight after the last forward when a submodule is called outside
# engine(...), and the next partition fails (upstream too): trained (385, 344) and frozen forward-only (487).
SCENARIOS["fuzz-385-z3-outside-call-forward-only"] = functools.partial(_fuzz_program, 385)
SCENARIOS["fuzz-344-z3-frozen-outside-call-retain"] = functools.partial(_fuzz_program, 344)
SCENARIOS["fuzz-487-z3-frozen-outside-call-no-grad-path"] = functools.partial(_fuzz_program, 487)
# ... and a frozen ZeRO-3 engine whose output requires grad but is used detached left it too: a
# frozen engine has no step() to drain it, so it now drains at the end of every forward (70408).
SCENARIOS["fuzz-70408-z3-frozen-outside-call-detached"] = functools.partial(_fuzz_program, 70408)
# A stage-0 bf16 engine was compared on its bf16 weights, where small updates round away (320).
SCENARIOS["fuzz-320-z0-bf16-outside-call"] = functools.partial(_fuzz_program, 320, "bf16")
for s in range(4):
    SCENARIOS[f"frozen-twice-z{s}"] = functools.partial(_frozen_twice, s)
SCENARIOS["outside-call-z3-bf16-gas2"] = functools.partial(_outside_call, 3, "bf16")
SCENARIOS["outside-call-tied-z3-fp16-gas3"] = functools.partial(_outside_call, 3, "fp16", 3, True)
SCENARIOS["llava-llama-z3-gas2"] = functools.partial(_llava, 3, arch="llama")
SCENARIOS["llava-llama-z3-fp16-gas2"] = functools.partial(_llava, 3, "fp16", arch="llama")


# DeepSpeed's knobs (issue 24). ZeRO-3 with reduce_scatter off and gradient_predivide_factor equal to
# the world size (2) averaged 2x too small in DeepSpeed (zero/stage3/predivide.py); 4 was right.
_NO_SCATTER = dict(reduce_scatter=False)


def _predivide(scenario, factor, **zero):
    """``scenario`` with gradient_predivide_factor ``factor`` and reduce_scatter off; checks that
    both reached DeepSpeed's optimizers and that the fix is on exactly where DeepSpeed needs it."""
    from deepspeed_multi import compat

    def took_effect(engines):
        for name, engine in engines.items():
            opt = engine.optimizer
            assert engine.gradient_predivide_factor() == factor, (name, engine.gradient_predivide_factor())
            if engine.zero_optimization_stage() == 3:
                assert opt.reduce_scatter is False and opt.gradient_predivide_factor == factor, name
                assert compat.installed(opt, "stage3_predivide"), f"{name}: the predivide fix is not installed"
    scenario = _knobs(scenario, {"gradient_predivide_factor": factor}, **_NO_SCATTER, **zero)
    scenario.took_effect = took_effect
    return scenario
SCENARIOS.update({
    "knob-z3-predivide-world-no-reduce-scatter": lambda: _predivide(_chain(2, 3, 2, 2), 2.0),
    "knob-z3-predivide-world-no-reduce-scatter-noncontiguous": lambda: _predivide(
        _chain(3, 3), 2.0, contiguous_gradients=False),
    "knob-z3-predivide-4-no-reduce-scatter": lambda: _predivide(_chain(2, 3, 2, 2), 4.0),
    "knob-z3-predivide-world-no-reduce-scatter-bf16": lambda: _predivide(_single(3, "bf16"), 2.0),
})




def _lora(stage, reentrant=True, gas=2, fed=False):
    """A PEFT LoRA Llama with gradient checkpointing (issue 24: reentrant at ZeRO-3 raised
    "active_backward_submodules is empty"), against plain PyTorch PEFT with the same checkpointing;
    ``fed``: its input embeddings come from a ZeRO-2 projector engine."""

    def loss(m, b, c):
        llm = m["llm"]
        if not fed:
            return llm(input_ids=b["ids"], labels=b["ids"]).loss
        text = mod(llm).get_input_embeddings()(b["ids"])
        return llm(inputs_embeds=text + m["proj"](text), labels=b["ids"]).loss

    def took_effect(engines):
        module = engines["llm"].module
        trained = [n for n, p in module.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in n for n in trained), trained
        assert module.base_model.model.is_gradient_checkpointing, "gradient checkpointing is off"

    members = {"llm": Member(functools.partial(lora_llama, 2, reentrant), ds_config(stage, gas=gas))}
    if fed:
        members["proj"] = Member(mlp(1, d_in=16, d_out=16), ds_config(2, gas=gas))
    return Scenario(members=members, phases=[Phase(loss)], batch=_llava_batch, took_effect=took_effect)


for _stage in (2, 3):
    SCENARIOS[f"knob-z{_stage}-lora-reentrant-gas2"] = functools.partial(_lora, _stage)
SCENARIOS["knob-z3-lora-reentrant-gas1"] = functools.partial(_lora, 3, gas=1)
SCENARIOS["knob-z3-lora-nonreentrant-gas2"] = functools.partial(_lora, 3, False)
SCENARIOS["knob-z3-lora-reentrant-fed-gas2"] = functools.partial(_lora, 3, fed=True)


# One family per DeepSpeed knob (issue 24): a diamond of three engines at ZeRO 1, 2 and 3 (a feeds
# b and c, whose outputs are summed), gas 2, the knob in every engine that accepts it; each row
# checks that the knob reached DeepSpeed (took_effect) besides the gradients.
def _diamond(stages=(1, 2, 3), dtype="fp32", gas=2):
    """a feeds b and c, whose outputs are summed."""
    members = {name: Member(mlp(i + 1), ds_config(stage, dtype, gas)) for i, (name, stage) in
               enumerate(zip("abc", stages))}

    def loss(m, b, c):
        h = m["a"](b["x"])
        return mse(m["b"](h) + m["c"](h), b["y"])

    return Scenario(members=members, phases=[Phase(loss)], dtype=dtype, micro_steps=6)


def _knob(took_effect, stages=(1, 2, 3), dtype="fp32", top=None, gas=2, **zero):
    scenario = _knobs(_diamond(stages, dtype, gas), top, **zero)
    scenario.took_effect = took_effect
    return scenario


def _each(check):
    """took_effect that runs ``check(name, engine)`` on every engine, naming the one that fails."""
    def took_effect(engines):
        for name, engine in engines.items():
            assert check(engine), f"engine {name!r} (ZeRO-{engine.zero_optimization_stage()}): the knob did not take effect"
    return took_effect


def _offloads_optimizer(engine):
    opt = engine.optimizer
    return opt.offload_optimizer if engine.zero_optimization_stage() == 3 else opt.cpu_offload


def _offloads_params(engine):
    return engine.zero_optimization_stage() != 3 or (engine.zero_offload_param() is not None
                                                     and engine.optimizer.offload_param)


def _data_types(grad_accum=None, comm=None):
    def check(engine):
        ok = True
        if grad_accum is not None:
            ok &= engine.get_data_types()[1] == grad_accum
        if comm is not None:
            ok &= engine.communication_data_type == comm
        return ok
    return check


def _hpz(engine):
    return engine.zero_optimization_stage() != 3 or engine.zero_hpz_partition_size() == 2


def _compiled(gas):
    """engine.compile() on every engine, with aot_eager: TorchDynamo and AOTAutograd trace forward
    and backward as with inductor, without inductor's C++ build (minutes on this CPU box)."""
    scenario = _diamond(gas=gas)
    scenario.prepare = lambda engines: [e.compile(backend="aot_eager") for e in engines.values()]
    scenario.took_effect = _each(lambda e: e.is_compiled)
    return scenario


def _monitored(gas):
    """DeepSpeed's CSV monitor in every engine, each writing under its own job name."""
    import tempfile
    root = tempfile.mkdtemp(prefix="dsm-monitor-")
    scenario = _diamond(gas=gas)
    for name, member in scenario.members.items():
        member.config["csv_monitor"] = {"enabled": True, "output_path": root, "job_name": name}

    def took_effect(engines):
        import os
        import deepspeed.comm as dist
        for name, e in engines.items():
            assert e.monitor.enabled, f"engine {name!r}: monitor not enabled"
            if dist.get_rank() == 0:
                written = [f for _, _, fs in os.walk(os.path.join(root, name)) for f in fs]
                assert written, f"engine {name!r}: the CSV monitor wrote nothing under {root}/{name}"
    scenario.took_effect = took_effect
    return scenario


def _offload_idle(stages, gas, every):
    """CPU offload, and engine a's ``fc2`` gets no gradient on some micro-steps (only a's ``fc1`` is
    called there, outside ``a(...)``): every other window (``every="window"``) or every other
    micro-step (``"micro"``). DeepSpeed applied the last window's gradient to ``fc2`` again there
    ([Note: stale offloaded gradients])."""
    scenario = _knob(_each(_offloads_optimizer), stages=stages, gas=gas, **_OFFLOAD_OPT)
    scenario.batch = _with_step(default_batch)

    def loss(m, b, c):
        step = int(b["step"])
        if (step // gas if every == "window" else step) % 2 == 1:
            h = torch.tanh(mod(m["a"]).fc1(b["x"]))[:, :8]
        else:
            h = m["a"](b["x"])
        return mse(m["b"](h) + m["c"](h), b["y"])

    scenario.phases = [Phase(loss)]
    return scenario


def _moe(stages, gas):
    """The models of the engines below ZeRO-3 hold a DeepSpeed MoE layer (models.MoEMLP; DeepSpeed
    refuses native MoE at ZeRO-3 with a clear error)."""
    scenario = _diamond(stages, gas=gas)
    for member, stage in zip(scenario.members.values(), stages):
        if stage < 3:
            member.build = functools.partial(MoEMLP, seed=member.build.keywords["seed"])
            member.param_groups = moe_param_groups
    scenario.took_effect = _each(lambda e: e.has_moe_layers == (e.zero_optimization_stage() < 3))
    return scenario


def _checkpoint_spans(reentrant, gas):
    """torch.utils.checkpoint around the whole diamond: the recomputation in backward calls all
    three engines again (ZeRO-3 gathers inside another engine's backward)."""
    from torch.utils.checkpoint import checkpoint
    scenario = _diamond(gas=gas)

    def loss(m, b, c):
        def body(x):
            h = m["a"](x)
            return m["b"](h) + m["c"](h)
        x = b["x"].clone().requires_grad_(reentrant)  # reentrant needs an input that requires grad
        return mse(checkpoint(body, x, use_reentrant=reentrant), b["y"])

    scenario.phases = [Phase(loss)]
    return scenario


def _opt_has(**attrs):
    """took_effect check: a ZeRO optimizer (stage >= 1) carries ``attrs``; stage 0 engines pass."""
    def check(engine):
        opt = engine.optimizer
        return engine.zero_optimization_stage() == 0 or all(getattr(opt, k) == v for k, v in attrs.items())
    return check


def _overlaps(engine):
    """ZeRO-2's optimizer keeps overlap_comm; ZeRO-3 passes it to its parameter offload (streams)."""
    if engine.zero_optimization_stage() == 3:
        return engine.zero_overlap_comm()
    return engine.optimizer.overlap_comm


def _overlap_below_stage2(engine):
    """[Note: overlap_comm below ZeRO-2]: DeepSpeed does not see the key at stages 0 and 1 (it refuses it
    there with unmanaged accumulation); ZeRO-1 reduces at the update in its backward's order instead."""
    from deepspeed_multi import compat
    stage = engine.zero_optimization_stage()
    if stage == 1:
        return not engine.optimizer.overlap_comm and compat.installed(engine.optimizer, "stage1_overlap_order")
    return stage == 0 or _overlaps(engine)


def _zero3_has(**attrs):
    """took_effect check: the ZeRO-3 engines' parameter coordinator settings (others pass)."""
    def check(engine):
        if engine.zero_optimization_stage() != 3:
            return True
        offload = engine.optimizer.parameter_offload
        return all(getattr(offload, k) == v for k, v in attrs.items())
    return check


def _block_sizes(stages, gas):
    """Every engine's config leaves the bucket and prefetch sizes unset: each takes its model's block
    (the largest Linear of these MLPs, no floor; [Note: sizes from the model's block]), several buckets
    per engine."""
    from deepspeed_multi.zero.block_sizes import block_elements
    scenario = _diamond(stages, gas=gas)
    for member in scenario.members.values():
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            member.config["zero_optimization"].pop(key)
        member.config.setdefault("deepspeed_multi", {})["min_block_elements"] = 0  # these blocks are tiny

    def sized(engine):
        block = block_elements(engine.module)
        zero = engine._config.zero_config
        return 0 < block < sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                               for p in engine.module.parameters()) and zero.reduce_bucket_size == block and (
            engine.zero_optimization_stage() != 3 or zero.prefetch_bucket_size == block)

    scenario.took_effect = _each(sized)
    return scenario


def _torch_autocast(stages, dtype, gas, distill=False):
    """DeepSpeed's torch_autocast (fp32 weights, each engine's forward under torch.autocast; Linear
    gradients communicated in ``dtype``) in every engine of the diamond, or, with ``distill``, on a
    ZeRO-2 student beside a frozen fp32 ZeRO-3 teacher. The reference runs the same forwards under
    torch.autocast; the tolerance is the low-precision one (the gradients are reduced in ``dtype``).
    In fp16 the boundary applies the GradScaler's scale ([Note: torch_autocast's GradScaler])."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    section = {"enabled": True, "dtype": {"bf16": "bfloat16", "fp16": "float16"}[dtype]}
    scenario = _distill() if distill else _diamond(stages, gas=gas)
    for member in scenario.members.values():
        if member.trainable or not distill:
            member.config["torch_autocast"] = dict(section)
            member.autocast = low
    scenario.dtype = dtype

    def took_effect(engines):
        for name, e in engines.items():
            want = scenario.members[name].autocast
            got = e.torch_autocast_dtype() if e.torch_autocast_enabled() else None
            assert got == want, f"engine {name!r}: torch_autocast {got}, configured {want}"
    scenario.took_effect = took_effect
    return scenario


_OFFLOAD_TOP = {"zero_force_ds_cpu_optimizer": False}  # the matrix's SGD, not DeepSpeedCPUAdam
_OFFLOAD_OPT = dict(top=_OFFLOAD_TOP, offload_optimizer={"device": "cpu"})
# At gas 2 upstream's diamond is wrong for another reason (a chain divides by gas twice: "What
# works"), so every knob also has a gas-1 row, where upstream's column measures the knob itself.
for _gas in (1, 2):
    SCENARIOS.update({
        f"knob-offload-optimizer-z123-gas{_gas}": functools.partial(_knob, _each(_offloads_optimizer), gas=_gas,
                                                                    **_OFFLOAD_OPT),
        f"knob-offload-optimizer-z123-bf16-gas{_gas}": functools.partial(
            _knob, _each(_offloads_optimizer), dtype="bf16", gas=_gas, **_OFFLOAD_OPT),
        f"knob-offload-param-z3-gas{_gas}": functools.partial(_knob, _each(_offloads_params), stages=(2, 3, 3),
                                                              gas=_gas, offload_param={"device": "cpu"}, **_OFFLOAD_OPT),
        f"knob-grad-accum-fp32-z123-bf16-gas{_gas}": functools.partial(
            _knob, _each(_data_types(grad_accum=torch.float32)), dtype="bf16", gas=_gas,
            top={"data_types": {"grad_accum_dtype": "fp32"}}),
        f"knob-comm-fp32-z123-bf16-gas{_gas}": functools.partial(
            _knob, _each(_data_types(comm=torch.float32)), dtype="bf16", gas=_gas,
            top={"communication_data_type": "fp32"}),
        f"knob-hpz-z3-gas{_gas}": functools.partial(_knob, _each(_hpz), stages=(2, 3, 3), gas=_gas,
                                                    zero_hpz_partition_size=2),
        f"knob-compile-z123-gas{_gas}": functools.partial(_compiled, _gas),
        f"knob-monitor-z123-gas{_gas}": functools.partial(_monitored, _gas),
        f"knob-moe-z012-gas{_gas}": functools.partial(_moe, (0, 1, 2), _gas),
        f"knob-offload-optimizer-idle-window-z123-gas{_gas}": functools.partial(_offload_idle, (1, 2, 3), _gas, "window"),
        f"knob-offload-optimizer-idle-window-z213-gas{_gas}": functools.partial(_offload_idle, (2, 1, 3), _gas, "window"),
        f"knob-offload-optimizer-idle-window-z312-gas{_gas}": functools.partial(_offload_idle, (3, 1, 2), _gas, "window"),
        # The reduction knobs the fuzzer also draws, one row each (refused combinations: docs/limits.md).
        f"knob-overlap-comm-z223-gas{_gas}": functools.partial(
            _knob, _each(_overlaps), stages=(2, 2, 3), gas=_gas, overlap_comm=True),
        f"knob-overlap-comm-z012-gas{_gas}": functools.partial(
            _knob, _each(_overlap_below_stage2), stages=(0, 1, 2), gas=_gas, overlap_comm=True),
        f"knob-noncontiguous-z123-gas{_gas}": functools.partial(
            _knob, _each(_opt_has(contiguous_gradients=False)), gas=_gas, contiguous_gradients=False),
        f"knob-no-reduce-scatter-z123-gas{_gas}": functools.partial(
            _knob, _each(_opt_has(reduce_scatter=False)), gas=_gas, reduce_scatter=False),
        f"knob-round-robin-z121-gas{_gas}": functools.partial(
            _knob, _each(_opt_has(round_robin_gradients=True)), stages=(1, 2, 1), gas=_gas, round_robin_gradients=True),
        f"knob-big-buckets-z123-gas{_gas}": functools.partial(
            _knob, _each(_opt_has(reduce_bucket_size=5 * 10**8)), gas=_gas, reduce_bucket_size=5 * 10**8,
            allgather_bucket_size=5 * 10**8, stage3_prefetch_bucket_size=5 * 10**8),
        f"knob-block-sizes-z123-gas{_gas}": functools.partial(_block_sizes, (1, 2, 3), _gas),
        f"knob-block-sizes-z332-gas{_gas}": functools.partial(_block_sizes, (3, 3, 2), _gas),
        f"knob-z3-persistent-live-reuse-z233-gas{_gas}": functools.partial(
            _knob, _each(_zero3_has(param_numel_persistence_threshold=64)), stages=(2, 3, 3), gas=_gas,
            stage3_param_persistence_threshold=64, stage3_max_live_parameters=256, stage3_max_reuse_distance=0),
        f"knob-predivide-z123-gas{_gas}": functools.partial(
            _knob, _each(_opt_has(gradient_predivide_factor=4.0)), gas=_gas,
            top={"gradient_predivide_factor": 4.0}, reduce_scatter=False),
        f"knob-prescale-z012-gas{_gas}": functools.partial(
            _knob, _each(_opt_has(postscale_gradients=False)), stages=(0, 1, 2), gas=_gas,
            top={"prescale_gradients": True}, reduce_scatter=False),
        f"knob-checkpoint-spans-engines-reentrant-z123-gas{_gas}": functools.partial(_checkpoint_spans, True, _gas),
        f"knob-checkpoint-spans-engines-nonreentrant-z123-gas{_gas}": functools.partial(_checkpoint_spans, False, _gas),
        f"knob-moe-beside-z3-gas{_gas}": functools.partial(_moe, (1, 2, 3), _gas),
        f"knob-torch-autocast-bf16-z012-gas{_gas}": functools.partial(_torch_autocast, (0, 1, 2), "bf16", _gas),
        f"knob-torch-autocast-bf16-z123-gas{_gas}": functools.partial(_torch_autocast, (1, 2, 3), "bf16", _gas),
        f"knob-torch-autocast-fp16-z012-gas{_gas}": functools.partial(_torch_autocast, (0, 1, 2), "fp16", _gas),
        f"knob-torch-autocast-fp16-z123-gas{_gas}": functools.partial(_torch_autocast, (1, 2, 3), "fp16", _gas),
    })


SCENARIOS["knob-torch-autocast-bf16-distill-z2-z3"] = functools.partial(_torch_autocast, None, "bf16", 1, True)
SCENARIOS["knob-offload-optimizer-idle-micro-z123-gas2"] = functools.partial(_offload_idle, (1, 2, 3), 2, "micro")
SCENARIOS["knob-offload-optimizer-idle-micro-z213-gas2"] = functools.partial(_offload_idle, (2, 1, 3), 2, "micro")


# Scenarios that cannot work and must fail with a clear error instead: name -> text of the error.
EXPECTED_ERRORS = {
    "grad-penalty-z3": "create_graph=True",
    **{f"direct-param-z{s}": "never crossed this engine's boundary" for s in range(3)},
    # ZeRO-3 re-partitions the parameter when GatheredParameters exits, so the direct use's own
    # backward fails inside autograd (torch's shape error) before any gradient reaches it.
    "direct-param-z3": "must match the size of tensor",
    **{f"direct-mixed-z{s}-{kind}": "from outside the engine's region" for s in range(3) for kind in ("gas2", "fp16")},
}


def check(name, initialize=None, report_dir=None):
    """Run scenario ``name`` through engines and the reference; raise on mismatch."""
    if name in EXPECTED_ERRORS:
        return _check_refused(name, initialize)
    import json
    import os

    import deepspeed.comm as dist

    from common import compare, run_engines, run_reference
    if initialize is None:
        import deepspeed_multi
        initialize = deepspeed_multi.initialize
    scenario = SCENARIOS[name]()
    engines = run_engines(scenario, initialize)
    if scenario.took_effect is not None:
        scenario.took_effect(engines)
    reference = run_reference(scenario)
    report = compare(engines, reference, scenario.members, scenario.dtype)
    report_dir = report_dir or os.environ.get("DSM_REPORT_DIR")
    if report_dir and dist.get_rank() == 0:
        os.makedirs(report_dir, exist_ok=True)
        with open(os.path.join(report_dir, f"{name}.json"), "w") as f:
            json.dump({"scenario": name, "dtype": scenario.dtype, "errors": report}, f)
    return report


def check_many(names, **kw):
    for name in names:
        try:
            check(name, **kw)
        except Exception as e:
            raise AssertionError(f"scenario {name!r} failed: {type(e).__name__}: {e}") from e


def _check_refused(name, initialize):
    from common import run_engines
    if initialize is None:
        import deepspeed_multi
        initialize = deepspeed_multi.initialize
    try:
        run_engines(SCENARIOS[name](), initialize)
    except RuntimeError as e:
        if EXPECTED_ERRORS[name] not in str(e):
            raise AssertionError(f"{name}: expected an error about {EXPECTED_ERRORS[name]!r}, got: {e}") from e
        return {"refused": str(e)}
    raise AssertionError(f"{name}: expected a clear RuntimeError ({EXPECTED_ERRORS[name]!r}), but it ran")


# The correctness matrix's core groups: what `make test` also runs on the oldest supported
# DeepSpeed (Makefile, test-oldest, selects them by the pytest mark "core"; test_matrix.py).
CORE = ("chain-z0", "chain-z1", "chain-z2", "chain-z3", "frozen-z3", "distill-z2", "rlhf-rlhf-4-engines", "llava-z3",
        "twice-z3", "step-z1", "partial-z3")


def groups():
    """Scenario names grouped so that each group runs in one set of processes (start-up is costly).

    A family (the name's first word and stage, e.g. chain-z2) of four or more scenarios, a core
    family and a family without a stage are a group each; the smaller families of one stage share
    a group (features-z1), so the matrix starts about 30 sets of processes rather than 70.
    """
    import re
    families = {}
    for name in SCENARIOS:
        match = re.search(r"z\d", name)
        key = name.split("-")[0] + ("-" + match.group(0) if match else "-" + name)
        families.setdefault(key, []).append(name)
    out = {}
    for key, names in families.items():
        stage = re.search(r"-(z\d)$", key)
        if len(names) >= 4 or key in CORE or stage is None:
            out[key] = names
        else:
            out.setdefault(f"features-{stage.group(1)}", []).extend(names)
    return out
