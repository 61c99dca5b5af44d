"""Rank functions of test_sequence_parallel.py's Trainer and Accelerate cases: DeepSpeed's Ulysses
sequence parallelism turned on the way Transformers and Accelerate users turn it on,
``ParallelismConfig(sp_size=2, sp_backend="deepspeed")``, on 2 CPU ranks (one data-parallel replica).

The Trainer runs (a causal LM, and TRL's SFTTrainer) are compared with the same job under a DDP
Trainer on the full sequences: the SP replica's micro-batch is the DDP job's global micro-batch
(``per_device_train_batch_size`` doubled), the same samples in the same order. Each SP run's
process-wide registration (the ``sdpa`` attention function, DeepSpeed's groups) is undone after it
(``sp_checks.undone``), so DDP runs and the other tests see plain attention.
"""
import contextlib
import copy

import torch
import torch.nn.functional as F

import deepspeed.comm as dist
import sp_checks
import trainer_checks as tc
from common import FP32_TOL, full_params
from hf_models import VOCAB, causal_lm

SP = 2


def parallelism(seq_length):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    return ParallelismConfig(sp_size=SP, sp_backend="deepspeed", sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length=seq_length, sp_seq_length_is_variable=False, sp_attn_implementation="sdpa"))


def _sp_args(seq_length):
    return dict(parallelism_config=parallelism(seq_length), per_device_train_batch_size=SP * tc.MICRO_BS)


def run_clm(trainer_cls, stage, gas):
    """The causal-LM Trainer job of trainer_checks, under SP (``trainer_cls`` ours or upstream's Trainer)."""
    with sp_checks.undone():
        return tc.run_trainer(trainer_cls, gas, 0.5, deepspeed=tc.ds_config(stage, gas, None), positions=True,
                              **_sp_args(tc.SEQ))[:2]


def _sft_rows():
    from datasets import Dataset
    g = torch.Generator().manual_seed(11)  # 15 words + EOS: 16 tokens, a multiple of the SP size
    return Dataset.from_list([{"text": " ".join(f"w{int(i)}" for i in torch.randint(3, 64, (15, ), generator=g))}
                              for _ in range(32)])


def run_sft(trainer_cls, gas, deepspeed=None, sp=False):
    """trainer_checks' SFT job on fixed-length rows, under SP (``sp``) or not."""
    kw = _sp_args(16) if sp else {}
    with sp_checks.undone() if sp else contextlib.nullcontext():
        return tc.run_sft(trainer_cls, gas, deepspeed, rows=_sft_rows(), padding_free=False, **kw)[:2]


def trainer_on_sp(cases=((1, 1), (2, 1), (3, 1), (2, 2)), sft=((2, 1), (3, 2))):
    """The Trainer on DeepSpeed SP against DDP on the full sequences (1e-5), ZeRO 1-3, gas 1/2; TRL's
    SFTTrainer likewise; where upstream is the reference (a GPU), upstream's Trainer on the same SP job
    at ZeRO-3 (upstream's ZeRO-1/2 double the gradients: [Note: averaging over the sequence-data-parallel
    group]); a second model under SP refused by name (TRL's DPO)."""
    from transformers import Trainer
    from trl import SFTTrainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    from deepspeed_multi.transformers import multi_engine_trainer
    upstream = tc.upstream_is_reference()
    ddp = {}
    for stage, gas in cases:
        if gas not in ddp:
            ddp[gas] = tc.run_trainer(Trainer, gas, 0.5)[:2]
        got = run_clm(MultiTrainer, stage, gas)
        tc.compare(got, ddp[gas], f"Trainer on SP {SP}, ZeRO-{stage} gas {gas}, vs DDP on the full sequences")
        if upstream and stage == 3:
            tc._against(True, got, run_clm(Trainer, stage, gas), f"Trainer on SP, ZeRO-3 gas {gas}")
    for stage, gas in sft:
        want = run_sft(SFTTrainer, gas)
        got = run_sft(multi_engine_trainer(SFTTrainer), gas, tc.ds_config(stage, gas, None), sp=True)
        tc.compare(got, want, f"SFT on SP {SP}, ZeRO-{stage} gas {gas}, vs DDP SFT on the full sequences")
    _dpo_on_sp_refused()
    return dist.get_rank()


def _dpo_on_sp_refused():
    from trl import DPOTrainer

    from deepspeed_multi.transformers import multi_engine_trainer
    with sp_checks.undone():
        tc.expect_error(ValueError, lambda: tc.run_dpo(
            multi_engine_trainer(DPOTrainer), 1, deepspeed=tc.ds_config(2, 1, None),
            roles={"ref_model": tc.ds_config(3, 1, None)}, max_length=16, pad_to_multiple_of=16, **_sp_args(16)),
            "a second model (LlamaForCausalLM)", "under DeepSpeed sequence parallelism", "SFTTrainer only")


# ------------------------------------------------------------------ Accelerate: several models on the SP groups
def value_model():
    """A critic: the tiny Llama with a one-output token-classification head (a value per token)."""
    from transformers import AutoModelForTokenClassification

    from hf_models import llama_config
    return AutoModelForTokenClassification.from_config(llama_config(num_labels=1, attn_implementation="sdpa",
                                                                    classifier_dropout=0.0))


def _rlhf_terms(policy, reference, head, b):
    """Per-token terms of an RLHF-style step on (a slice of) a batch: the policy's cross entropy, a KL-like
    distance to the frozen reference's log-probabilities, and a value model's squared per-token output.
    Returns (sum over the labelled tokens, their count)."""
    out = policy(input_ids=b["ids"], position_ids=b["pos"])
    with torch.no_grad():
        ref_logits = reference(input_ids=b["ids"], position_ids=b["pos"]).logits
    mask = (b["shift"] != -100).float()
    ce = F.cross_entropy(out.logits.reshape(-1, VOCAB).float(), b["shift"].reshape(-1), ignore_index=-100,
                         reduction="none").view_as(mask)
    kl = (out.logits.float().log_softmax(-1) - ref_logits.float().log_softmax(-1)).pow(2).mean(-1)
    value = head(input_ids=b["ids"], position_ids=b["pos"]).logits.squeeze(-1)
    per_token = ce + 0.1 * kl + 0.1 * value.pow(2)
    return (per_token * mask).sum(), mask.sum()


def accelerate_several_models_on_sp(stages=(3, 3, 2), steps=3):
    """A sequence-parallel policy (ZeRO ``stages[0]``), its frozen sequence-parallel reference (``stages[1]``)
    and a sequence-parallel value model (``stages[2]``; Accelerate registers Ulysses for Transformers models
    only) prepared one by one through deepspeed_multi's Accelerator with
    ``ParallelismConfig(sp_backend="deepspeed")``, one ``accelerator.backward`` a step, against plain PyTorch
    on the full sequences ([Note: one Ulysses registration for every model]). Returns the max abs error."""
    from accelerate.utils import DeepSpeedPlugin

    import sp_checks
    from common import ds_config
    from deepspeed_multi.accelerate import Accelerator
    from hf_common import reset_accelerate
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    rank = dist.get_rank()
    unset_hf_deepspeed_config()  # (a ZeRO-3 config left by an earlier Accelerator would build these under zero.Init)
    torch.manual_seed(0)
    policy, reference = causal_lm(attn_implementation="sdpa"), causal_lm(attn_implementation="sdpa")
    head = value_model()
    reference.requires_grad_(False)
    plain = [copy.deepcopy(m) for m in (policy, reference, head)]
    opts = [torch.optim.SGD(m.parameters(), lr=sp_checks.LR) for m in (plain[0], plain[2])]
    for step in range(steps):  # plain PyTorch on the full sequences, before any registration
        total, count = _rlhf_terms(*plain, sp_checks.replica_batch(step, 0))
        (total / count).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    want = [full_params(plain[0]), full_params(plain[2])]
    reset_accelerate()
    with sp_checks.undone():
        config = lambda stage: ds_config(stage, micro_bs=sp_checks.BATCH)  # noqa: E731
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config(stages[0])),
                                  parallelism_config=parallelism(sp_checks.LENGTH))
        p_engine, p_opt = accelerator.prepare(policy, torch.optim.SGD(policy.parameters(), lr=sp_checks.LR))
        r_engine = accelerator.prepare(reference, deepspeed_plugin=config(stages[1]))
        h_engine, h_opt = accelerator.prepare(head, torch.optim.SGD(head.parameters(), lr=sp_checks.LR),
                                              deepspeed_plugin=config(stages[2]))
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        group = parallel_state_sp.get_sequence_parallel_group()
        for step in range(steps):
            b = sp_checks.local_slice(sp_checks.replica_batch(step, 0), rank % SP, SP)
            total, count = _rlhf_terms(p_engine, r_engine, h_engine, b)
            accelerator.backward(sp_checks.sp_weighted(total / count.clamp(min=1), b["shift"], group))
            for o in (p_opt, h_opt):
                o.step()
                o.zero_grad()
        got = [full_params(p_engine), full_params(h_engine)]
        for e in (p_engine, r_engine, h_engine):
            e.destroy()
        unset_hf_deepspeed_config()
    err = max((g[n] - w[n]).abs().max().item() for g, w in zip(got, want) for n in w)
    assert err <= FP32_TOL, f"policy ZeRO-{stages[0]}, reference ZeRO-{stages[1]}, head ZeRO-{stages[2]} on SP {SP}: " \
                            f"max abs error {err:.3e} vs plain PyTorch on the full sequences"
    return err
