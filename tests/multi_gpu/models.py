"""Small test models with the output structures and features the scenarios need."""
from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from common import MLP

Pair = namedtuple("Pair", ["out", "hidden"])


@dataclass
class Output:
    out: torch.Tensor
    hidden: torch.Tensor
    note: str = "not a tensor"


class StructuredMLP(MLP):
    """Returns its output inside a dict, dataclass, named tuple or nested list."""

    def __init__(self, kind="dict", **kw):
        super().__init__(**kw)
        self.kind = kind

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)
        hidden = torch.tanh(self.fc1(x))
        out = self.fc2(hidden).float()
        hidden = hidden.float()
        if self.kind == "dict":
            return {"out": out, "hidden": hidden, "count": 3}
        if self.kind == "dataclass":
            return Output(out, hidden)
        if self.kind == "namedtuple":
            return Pair(out, hidden)
        return [[out], (hidden, None)]


def structured_out(result):
    if isinstance(result, dict):
        return result["out"], result["hidden"]
    if isinstance(result, Output):
        return result.out, result.hidden
    if isinstance(result, tuple):
        return result.out, result.hidden
    return result[0][0], result[1][0]


class CheckpointedMLP(MLP):
    """fc1 under activation checkpointing (reentrant or not)."""

    def __init__(self, reentrant=True, **kw):
        super().__init__(**kw)
        self.reentrant = reentrant

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)
        if self.reentrant and not x.requires_grad:
            # Reentrant checkpointing needs an input that requires grad to record anything.
            x = x.detach().requires_grad_(True)
        h = checkpoint(lambda t: torch.tanh(self.fc1(t)), x, use_reentrant=self.reentrant)
        return self.fc2(h).float()


class Scalar(nn.Module):
    """A critic/reward/discriminator head: MLP then a mean over features."""

    def __init__(self, seed=0):
        super().__init__()
        self.body = MLP(seed=seed)

    def forward(self, x):
        return self.body(x).mean(dim=-1)


class TwoHeads(MLP):
    """A trunk and two heads; each call uses one head, so a head can miss a whole micro-batch."""

    def __init__(self, seed=0):
        super().__init__(seed=seed)
        g = torch.Generator().manual_seed(seed + 100)
        self.head2 = nn.Linear(8, 8)
        with torch.no_grad():
            for p in self.head2.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, head):
        h = super().forward(x)
        return self.head2(h) if head == 2 else h


class InplaceInputMLP(MLP):
    """Modifies its input in place before using it, as a first ReLU(inplace=True) would."""

    def forward(self, x):
        x.mul_(2.0)
        return super().forward(x)


class EmbBody(nn.Module):
    """``emb`` is meant to be called by the user outside ``engine(...)``; forward runs only ``body``.

    With ``tied=True`` a ``head`` inside forward shares ``emb``'s weight, so one parameter is
    reached both inside and outside ``engine(...)`` in one backward (tied input/output embeddings).
    """

    def __init__(self, seed=0, tied=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Linear(8, 8)
        self.body = MLP(seed=seed + 1)
        self.head = nn.Linear(8, 8, bias=False) if tied else None
        with torch.no_grad():
            for p in (self.emb.weight, self.emb.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, h):
        out = self.body(h)
        return self.head(out.to(self.emb.weight.dtype)).float() if self.head is not None else out


class MoEMLP(MLP):
    """An MLP with a DeepSpeed MoE layer (2 experts, top-1, expert-parallel size 1) between its
    layers; deterministic routing (no random token selection; capacity factor 2 = the number of
    experts, so no token is dropped), and the gate's auxiliary loss added to the output so that
    the gate trains through both."""

    def __init__(self, seed=0, aux_weight=0.01):
        super().__init__(seed=seed)
        from deepspeed.moe.layer import MoE
        torch.manual_seed(seed)
        self.moe = MoE(hidden_size=16, expert=nn.Linear(16, 16), num_experts=2, ep_size=1, k=1, use_rts=False,
                       capacity_factor=2.0, eval_capacity_factor=2.0, min_capacity=0)
        self.aux_weight = aux_weight

    def forward(self, x):
        x = x.to(self.fc1.weight.dtype)
        h, aux, _ = self.moe(torch.tanh(self.fc1(x)))
        return (self.fc2(h) + self.aux_weight * aux).float()


def moe_param_groups(params):
    """The optimizer's param groups DeepSpeed requires for MoE: expert parameters apart."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    return split_params_into_different_moe_groups_for_optimizer({"params": list(params), "name": "all"})


def tiny_causal_lm(arch="gpt2", seed=0):
    """A Hugging Face causal LM from a tiny config with random weights (nothing is downloaded)."""
    import transformers
    torch.manual_seed(seed)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                          use_cache=False, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


def lora_llama(seed=0, reentrant=True):
    """tiny_causal_lm("llama") with PEFT LoRA adapters on the attention projections and gradient
    checkpointing on (the TRL + PEFT default), its adapters' B matrices non-zero so that both
    adapter matrices get gradients from the first step."""
    from peft import LoraConfig, get_peft_model
    model = tiny_causal_lm("llama", seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
    return model
