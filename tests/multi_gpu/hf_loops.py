"""The loops of issue 8 (seed 000's RFC, seed 002's guide, encoder->LLM, GAN), as hf_common.Loop objects."""
import functools

import torch
import torch.nn.functional as F

import hf_models as hm
from common import MLP, ds_config
from hf_common import Loop, Member, Phase
from models import Scalar


def cfg(stage, gas=1, micro_bs=4, **extra):
    return ds_config(stage, gas=gas, micro_bs=micro_bs, **extra)


# ----------------------------------------------------------------------------- distillation (seed 002)
def _lm_batch(step, rank, n=4, length=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = hm.tokens(g, n, length)
    return {"input_ids": ids, "labels": ids}


def _distill_loss(m, b, c):
    with torch.no_grad():
        t = m["teacher"](**b)
    s = m["student"](**b)
    kl = F.kl_div(F.log_softmax(s.logits, -1), F.log_softmax(t.logits, -1), log_target=True, reduction="batchmean")
    return t.loss + s.loss + kl                 # the guide's loss (teacher's term is a constant) plus a KL


def distillation(prepare="select"):
    return Loop("distillation", {"student": Member(hm.causal_lm, cfg(2)),
                                 "teacher": Member(functools.partial(hm.causal_lm, num_hidden_layers=2), cfg(3),
                                                   trainable=False)},
                [Phase(_distill_loss, after=(("step", "student"), ("zero_grad", "student")))], _lm_batch,
                prepare=prepare)


def distillation_config_optimizer(gas=2):
    """The guide's zero2_config style: optimizer and scheduler in the student's DeepSpeed config
    (prepared with DummyOptim/DummyScheduler; DeepSpeed steps the schedule inside each update)."""
    student_cfg = cfg(2, gas, optimizer={"type": "SGD", "params": {"lr": 0.1}},
                      scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.02, "warmup_max_lr": 0.1,
                                                                "warmup_num_steps": 3, "warmup_type": "linear"}})
    loop = distillation()
    loop.name = f"distillation-config-optimizer-gas{gas}"
    loop.members["student"].config = student_cfg
    return loop


# ----------------------------------------------------------------------------- encoder -> LLM (seed 001)
def _mm_batch(step, rank, n=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g), "labels": hm.tokens(g, n, 5)}


def _mm_loss(m, b, c):
    feats = m["encoder"](pixel_values=b["pixel_values"]).last_hidden_state     # (n, 1 + 4 patches, 16)
    return m["llm"](inputs_embeds=m["projector"](feats), labels=b["labels"]).loss


def encoder_llm(gas=1, llm_trained=True):
    """``gas``: one number for every config, or (encoder, projector, llm) for per-model accumulation."""
    g_enc, g_proj, g_llm = gas if isinstance(gas, tuple) else (gas, gas, gas)
    after = [("step", "encoder"), ("step", "projector")] + ([("step", "llm")] if llm_trained else [])
    after += [("zero_grad", n) for _, n in after]
    tag = "".join(map(str, gas)) if isinstance(gas, tuple) else gas
    name = f"encoder-llm{'' if llm_trained else '-frozen'}-gas{tag}"
    return Loop(name, {"encoder": Member(hm.vit_encoder, cfg(2, g_enc)),
                       "projector": Member(lambda: torch.nn.Linear(hm.HIDDEN, hm.HIDDEN), cfg(1, g_proj)),
                       "llm": Member(hm.causal_lm, cfg(3, g_llm), trainable=llm_trained)},
                [Phase(_mm_loss, after=tuple(after))], _mm_batch, steps=4)


# ----------------------------------------------------------------------------- GAN alternation
def _vec_batch(step, rank, n=4, d=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(n, d, generator=g), "y": torch.randn(n, d, generator=g)}


def _d_loss(m, b, c):
    fake = m["G"](b["x"]).detach()
    return F.softplus(-m["D"](b["y"])).mean() + F.softplus(m["D"](fake)).mean()


def _g_loss(m, b, c):
    return F.softplus(-m["D"](m["G"](b["x"]))).mean()     # flows through D; D's gradients are dropped after


def gan():
    return Loop("gan", {"G": Member(functools.partial(MLP, seed=1), cfg(2)),
                        "D": Member(functools.partial(Scalar, seed=2), cfg(3))},
                [Phase(_d_loss, after=(("step", "D"), ("zero_grad", "D"))),
                 Phase(_g_loss, after=(("step", "G"), ("zero_grad", "G"), ("zero_grad", "D")))], _vec_batch)


# ----------------------------------------------------------------------------- RFC PPO loop (seed 000)
PROMPT, NEW = 4, 2


def _ppo_batch(step, rank, n=2):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"prompts": hm.tokens(g, n, PROMPT)}


def _logprobs(logits, seq):
    return torch.log_softmax(logits[:, PROMPT - 1:-1].float(), -1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


def _ppo_setup(m, b, c):
    prompts = b["prompts"]
    seq = m["actor"].generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    seq = seq.clamp(min=3)      # keep the pad id out, so the scorers read the last token
    c["seq"] = seq
    c["old_logp"] = _logprobs(m["actor"](input_ids=seq).logits, seq)
    ref_logp = _logprobs(m["reference"](input_ids=seq).logits, seq)
    reward = m["reward"](input_ids=seq).logits.squeeze(-1)
    c["values"] = m["critic"](input_ids=seq).logits.squeeze(-1)
    c["returns"] = reward - 0.1 * (c["old_logp"] - ref_logp).sum(-1)
    c["adv"] = c["returns"] - c["values"]


def _actor_loss(m, b, c):
    logp = _logprobs(m["actor"](input_ids=c["seq"], use_cache=False).logits, c["seq"])
    ratio = torch.exp(logp - c["old_logp"]).mean(-1)
    return -torch.min(ratio * c["adv"], ratio.clamp(0.8, 1.2) * c["adv"]).mean()


def _critic_loss(m, b, c):
    value = m["critic"](input_ids=c["seq"]).logits.squeeze(-1)
    return ((value - c["returns"])**2).mean()


def rfc_ppo(ppo_steps=2, prepare="per_call"):
    phases = []
    for _ in range(ppo_steps):
        phases += [Phase(_actor_loss, after=(("step", "actor"), ("zero_grad", "actor"))),
                   Phase(_critic_loss, after=(("step", "critic"), ("zero_grad", "critic")))]
    return Loop("rfc-ppo", {"actor": Member(hm.causal_lm, cfg(2, micro_bs=2)),
                            "critic": Member(hm.scorer, cfg(3, micro_bs=2)),
                            "reference": Member(hm.causal_lm, cfg(3, micro_bs=2), trainable=False),
                            "reward": Member(hm.scorer, cfg(3, micro_bs=2), trainable=False)},
                phases, _ppo_batch, steps=2, setup=_ppo_setup, world_size=4, prepare=prepare)


# ----------------------------------------------------------------------------- HF gradient checkpointing
def _checkpointed_lm():
    model = hm.causal_lm()
    model.gradient_checkpointing_enable()
    return model.train()


def llm_gradient_checkpointing():
    return Loop("llm-z3-gradient-checkpointing", {"llm": Member(_checkpointed_lm, cfg(3))},
                [Phase(lambda m, b, c: m["llm"](**b).loss, after=(("step", "llm"), ("zero_grad", "llm")))],
                _lm_batch, steps=3)
