"""transformers.Trainer on MultiEngines against the same job under a DDP Trainer (rank functions).

Each job: a tiny Llama built from a config (the same starting weights for both), an in-memory
dataset of random token ids, 2 CPU ranks, AdamW with a linear schedule, ``max_grad_norm`` on.
The DDP Trainer is the reference: logged losses, ``grad_norm`` and learning rates, and the final
weights must match to 1e-5 (fp32).
"""
import contextlib
import copy
import os
import tempfile

import torch

import deepspeed.comm as dist

from common import FP32_TOL, expect_error
from hf_common import reset_accelerate
from hf_models import causal_lm, tokens

SEQ, MICRO_BS, SAMPLES = 8, 2, 40


class TokenData(torch.utils.data.Dataset):
    """``positions``: each sample carries ``position_ids`` (Ulysses sequence parallelism needs them)."""

    def __init__(self, n=SAMPLES, seed=7, positions=False):
        g = torch.Generator().manual_seed(seed)
        self.ids = tokens(g, n, SEQ)
        self.positions = positions

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        row = {"input_ids": self.ids[i], "labels": self.ids[i]}
        return dict(row, position_ids=torch.arange(SEQ)) if self.positions else row


def ds_config(stage, gas, clip):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto" if clip is None else clip, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _args(out, gas, max_grad_norm, deepspeed=None, args_cls=None, **kw):
    """``args_cls`` (TrainingArguments, or a TRL config) with the fields every job here shares."""
    from transformers import TrainingArguments
    args = dict(output_dir=out, per_device_train_batch_size=MICRO_BS, gradient_accumulation_steps=gas,
                learning_rate=2e-2, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=max_grad_norm,
                num_train_epochs=1, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=not torch.cuda.is_available(), seed=0,
                data_seed=0, dataloader_drop_last=True, disable_tqdm=True, deepspeed=deepspeed)
    args.update(kw)
    return (args_cls or TrainingArguments)(**args)


TRL_BF16 = [False]  # the TRL jobs' precision: bf16 while trl_in_bf16() runs them


@contextlib.contextmanager
def trl_in_bf16():
    """The TRL jobs below in bf16 (``bf16=True``, as TRL's shipped launcher configs run them)."""
    TRL_BF16[0] = True
    try:
        yield
    finally:
        TRL_BF16[0] = False


def _trl_args(config_cls, gas, deepspeed=None, **kw):
    """A TRL trainer's config for these jobs: fp32 (bf16 inside ``trl_in_bf16``), ``max_grad_norm`` 0.5, a fresh
    shared directory."""
    return _args(_shared_tmp(), gas, 0.5, copy.deepcopy(deepspeed), args_cls=config_cls, bf16=TRL_BF16[0], **kw)


LAUNCH_ENV = {}  # the ACCELERATE_* variables a launcher exports, while trainer_drop_in_checks.launched_by runs


def _clear_ds_env():
    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE", *LAUNCH_ENV):
        os.environ.pop(key, None)


def _fresh_process_state():
    """A new Accelerate state, no DeepSpeed launch variables (but a launcher's, inside ``launched_by``), the same
    seed for every run."""
    reset_accelerate()
    _clear_ds_env()
    os.environ.update(LAUNCH_ENV)
    torch.manual_seed(0)


def _train(trainer, resume=None):
    """Train; return (log history of the training steps, final full weights by name, trainer),
    leaving no Transformers DeepSpeed config or launch variables behind for the next run."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    weights = _full_weights(trainer)
    unset_hf_deepspeed_config()
    _clear_ds_env()
    return logs, weights, trainer


def run_trainer(trainer_cls, gas, max_grad_norm, deepspeed=None, out=None, loss_kwargs=True, resume=None,
                model=None, evaluate_first=False, positions=False, **args):
    """Train once; return (log history of the training steps, final full weights by name, trainer).

    ``loss_kwargs=False``: the Trainer divides each micro-batch's loss by its accumulation count
    (a model that takes no ``num_items_in_batch``) instead of normalizing by the window's tokens.
    ``model``: train this model instead of a new tiny Llama. ``evaluate_first``: ``evaluate()``
    before ``train()`` (under a ZeRO-3 config that builds an inference engine, which train() lets go of).
    """
    _fresh_process_state()
    # (The model before the arguments: under their ZeRO-3 config from_config would build it under zero.Init.)
    model = model if model is not None else causal_lm()
    out = out or _shared_tmp()
    trainer = trainer_cls(model=model, args=_args(out, gas, max_grad_norm, copy.deepcopy(deepspeed), **args),
                          train_dataset=TokenData(positions=positions), eval_dataset=TokenData(8, seed=3))
    if not loss_kwargs:
        trainer.model_accepts_loss_kwargs = False
    if evaluate_first:
        trainer.evaluate()
        assert deepspeed is None or not trainer.model_wrapped.has_optimizer  # the inference engine it built
    result = _train(trainer, resume)
    if deepspeed is not None and hasattr(trainer.accelerator, "engines"):  # (upstream's Trainer: no engines())
        engines = trainer.accelerator.engines()
        assert len(engines) == 1 and engines[0].zero_optimization_stage() == deepspeed["zero_optimization"]["stage"]
    return result


def _shared_tmp():
    """One directory for every rank (rank 0 makes it)."""
    holder = [tempfile.mkdtemp(prefix="dsm_trainer_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _full_weights(trainer):
    return _weights_of(trainer.model_wrapped)


def _weights_of(model):
    """The full weights by name of a module, a DDP-wrapped one or an engine (ZeRO-3 gathered)."""
    import deepspeed
    module = getattr(model, "module", model)
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().clone().float() for n, p in params.items()}


def compare_bitwise(got, want, what):
    """A resumed run against the uninterrupted one (or ours against upstream): the same logged steps, every
    logged loss, grad_norm and learning rate and every final weight bit-identical (fp32)."""
    (glogs, gweights), (wlogs, wweights) = got, want
    assert [h["step"] for h in glogs] == [h["step"] for h in wlogs], (what, glogs, wlogs)
    for g, w in zip(glogs, wlogs):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert (key in g) == (key in w), f"{what}: step {w['step']} logs {key} on one side only: {g}, {w}"
            if key not in w:  # (no grad_norm where DeepSpeed computes none: fp32 at ZeRO-0)
                continue
            same = g[key] == w[key] or (g[key] != g[key] and w[key] != w[key])
            assert same, f"{what}: step {w['step']} {key} {g[key]!r}, reference {w[key]!r}"
    errs = {n: (gweights[n] - wweights[n]).abs().max().item() for n in wweights}
    worst = max(errs, key=errs.get)
    assert errs[worst] == 0, f"{what}: final weights differ from the uninterrupted run's by {errs[worst]:.3e} (at {worst})"


# 8 updates with a checkpoint at each, across epoch boundaries (this dataset gives 5 updates an epoch at gas 2,
# the LLaVA one 3), a schedule and weight decay that make every update's learning rate and decay matter.
ACROSS_EPOCHS = dict(max_steps=8, save_strategy="steps", save_steps=1, lr_scheduler_type="cosine", warmup_steps=2,
                     weight_decay=0.1)


def upstream_is_reference():
    """Whether a check compares with upstream DeepSpeed on the same job (bit-identical) instead of DDP.

    On a GPU the reference for a DeepSpeed engine is upstream DeepSpeed wherever upstream can run the
    job: DDP's arithmetic differs from DeepSpeed's there (DeepSpeed's fp16 keeps 16-bit weights where
    DDP runs fp32 weights under autocast; another order of the gradient-norm sum), so a DDP reference
    fails on our engines and upstream's alike (measured on an H200: DPO's grad_norm 3.0e-5 off DDP's
    at step 15, ours and upstream's bit-identical). On CPU DDP stays the reference (1e-5).
    ``DSM_TEST_UPSTREAM_REFERENCE=1`` takes the GPU's reference on CPU too (to run that branch here)."""
    return torch.cuda.is_available() or os.environ.get("DSM_TEST_UPSTREAM_REFERENCE") == "1"


# Where DDP stays the reference on a GPU (upstream cannot run the job: a model in parts), the logged values'
# tolerance is upstream's own distance from DDP on a job both run, measured on an H200 (TRL's DPO, policy
# ZeRO-2, reference ZeRO-3: grad_norm 3.0e-5 relative at step 15, every other value within 1e-5; final
# weights 3.6e-7), with the step to the next power of ten; on CPU DeepSpeed's and DDP's arithmetic agree to 1e-5.
LOG_TOL = 1e-4 if torch.cuda.is_available() else FP32_TOL


def compare(got, want, what):
    (glogs, gweights), (wlogs, wweights) = got, want
    assert len(glogs) == len(wlogs) and len(wlogs) >= 2, f"{what}: {len(glogs)} logged steps, DDP {len(wlogs)}"
    for g, w in zip(glogs, wlogs):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert abs(g[key] - w[key]) <= LOG_TOL * max(1.0, abs(w[key])), \
                f"{what}: step {w['step']} {key} {g[key]!r} vs DDP {w[key]!r}"
    errs = {n: (gweights[n] - wweights[n]).abs().max().item() for n in wweights}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= FP32_TOL, f"{what}: final weights differ from DDP's by {errs[worst]:.3e} (at {worst})"


def _against(upstream, got, want, what):
    """``got`` against the reference run ``want``: upstream's same job bit for bit where upstream is the
    reference (``upstream_is_reference``; the gradient norm too, at ZeRO-3 as well: measured on CPU with
    DSM_TEST_UPSTREAM_REFERENCE=1 for the Trainer at ZeRO 1-3, gas 1-4, and every TRL trainer here), else
    DDP's within 1e-5."""
    if upstream:
        compare_bitwise(got[:2], want[:2], f"{what}, against upstream")
    else:
        compare(got[:2], want[:2], f"{what}, against DDP")


def trainer_vs_ddp(cases):
    """``cases``: (stage, gas, max_grad_norm, loss_kwargs) each; ours vs a DDP Trainer on the same job."""
    from transformers import Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    upstream = upstream_is_reference()
    refs = {}
    for stage, gas, max_grad_norm, loss_kwargs in cases:
        key = (stage if upstream else None, gas, max_grad_norm, loss_kwargs)
        if key not in refs:
            logs, weights, _ = run_trainer(Trainer, gas, max_grad_norm, loss_kwargs=loss_kwargs,
                                           deepspeed=ds_config(stage, gas, None) if upstream else None)
            refs[key] = (logs, weights)
        logs, weights, _ = run_trainer(MultiTrainer, gas, max_grad_norm, deepspeed=ds_config(stage, gas, None),
                                       loss_kwargs=loss_kwargs)
        _against(upstream, (logs, weights), refs[key], f"ZeRO-{stage} gas {gas} max_grad_norm {max_grad_norm} "
                                                      f"{'token-normalized' if loss_kwargs else 'divided by gas'}")
    _scale_wrt_gas_refused_outside_trainer()
    zero0_vs_upstream()
    return dist.get_rank()


def zero0_vs_upstream(gas=2):
    """ZeRO stage 0 under our Trainer (LLaMA-Factory ships ds_z0_config.json) trains as under upstream's
    Trainer on the same job, bit for bit: in fp32 neither logs a grad_norm (DeepSpeed's fp32 ZeRO-0 update
    clips at gradient_clipping without keeping the norm, so the Trainer's clip_grad_norm_ gets None, asked
    twice), in bf16 both log the norm DeepSpeed's bf16 optimizer computes. Upstream, not DDP, is the
    reference: DDP logs a norm where DeepSpeed has none."""
    from transformers import Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    for bf16 in (False, True):
        config = dict(ds_config(0, gas, None), **({"bf16": {"enabled": "auto"}} if bf16 else {}))
        want = run_trainer(Trainer, gas, 0.5, deepspeed=config, bf16=bf16)
        got = run_trainer(MultiTrainer, gas, 0.5, deepspeed=config, bf16=bf16)
        assert all(("grad_norm" in h) == bf16 for h in want[0] + got[0]), (bf16, want[0], got[0])
        compare_bitwise(got[:2], want[:2], f"ZeRO-0 {'bf16' if bf16 else 'fp32'} gas {gas}, against upstream")


def again_vs_ddp(stages, gas=2):
    """Train, then train the same model again in a new Trainer (after ``destroy()`` of the first
    engine, [Note: destroy() hands the module back]): both runs' logs and the final weights equal
    DDP Trainers' doing the same. A second ``train()`` on the same Trainer is refused with a clear
    error (upstream DeepSpeed fails there; a DDP Trainer would keep the optimizer state)."""
    from transformers import Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer

    def run(trainer_cls, deepspeed=None):
        first, _, trainer = run_trainer(trainer_cls, gas, 0.5, deepspeed=deepspeed)
        if deepspeed is not None:
            expect_error(RuntimeError, trainer.train, "train() was already called on this trainer")
            trainer.model_wrapped.destroy()
            expect_error(RuntimeError, trainer.model_wrapped.step, "after engine.destroy()")
        second, weights, _ = run_trainer(trainer_cls, gas, 0.5, deepspeed=deepspeed, model=trainer.model)
        return first, second, weights

    want = run(Trainer)
    for stage in stages:
        got = run(MultiTrainer, ds_config(stage, gas, None))
        compare((got[0], want[2]), (want[0], want[2]), f"ZeRO-{stage}, first Trainer")
        compare((got[1], got[2]), (want[1], want[2]), f"ZeRO-{stage}, a new Trainer over the trained model")
    evaluate_then_train_vs_ddp()
    return dist.get_rank()


EVAL_EVERY_2 = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)


def evaluate_then_train_vs_ddp(stage=3, gas=2):
    """``evaluate()`` before ``train()`` (ZeRO-3 builds an inference engine for it), then training with
    an evaluation every 2 steps: the training logs, the evaluation losses and the final weights equal
    a DDP Trainer's that did not evaluate first (1e-5). Not against a DDP
    Trainer that evaluated first: there transformers 5.23 trains without wrapping the model in DDP
    (evaluate's ``prepare_model(evaluation_mode=True)``; measured: grad_norm 1.090 vs 0.777 at step 1,
    the ranks' weights 0.10 apart at the end)."""
    from transformers import Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    what = f"ZeRO-{stage}, evaluate() then train()"
    *got, trainer = run_trainer(MultiTrainer, gas, 0.5, deepspeed=ds_config(stage, gas, None), evaluate_first=True,
                                **EVAL_EVERY_2)
    *want, ddp = run_trainer(Trainer, gas, 0.5, **EVAL_EVERY_2)
    compare(got, want, what)
    compare_evals(trainer, ddp, what)


def compare_evals(trainer, ddp, what):
    """The evaluation losses logged during training by ``trainer`` and by the DDP ``ddp``: at least two,
    equal to 1e-5."""
    got, want = ([h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (trainer, ddp))
    assert len(got) == len(want) >= 2 and all(abs(a - b) <= FP32_TOL for a, b in zip(got, want)), \
        f"{what}: evaluation losses during training {got} vs DDP {want}"


def _scale_wrt_gas_refused_outside_trainer():
    """The plain Accelerator's engines divide by their own gas: a loss the caller divided is refused."""
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_multi.accelerate import Accelerator
    reset_accelerate()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(2, 1, 1.0) | {
        "train_micro_batch_size_per_gpu": MICRO_BS, "gradient_accumulation_steps": 1}))
    loss = torch.ones(2, requires_grad=True).sum()
    try:
        accelerator.backward(loss, scale_wrt_gas=False)
    except ValueError as e:
        assert "deepspeed_multi.transformers.Trainer" in str(e), e
    else:
        raise AssertionError("backward(scale_wrt_gas=False) was accepted by the plain Accelerator")
    reset_accelerate()


def save_resume_and_from_pretrained(stage, gas=2):
    """8 updates under Trainer with a checkpoint at every step (ACROSS_EPOCHS), equal to DDP's; resumed
    with resume_from_checkpoint in a new Trainer from inside the first epoch (step 2; the epoch ends at
    step 5) and at its end (step 5), each run ends bit-identical to the uninterrupted one;
    save_model -> from_pretrained gives the trained weights."""
    from transformers import AutoModelForCausalLM, Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    cfg = ds_config(stage, gas, None)
    # As under upstream DeepSpeed: without this key a ZeRO-3 save_model writes a DeepSpeed checkpoint only.
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    out = _shared_tmp()
    whole, weights, trainer = run_trainer(MultiTrainer, gas, 0.5, deepspeed=cfg, out=out, **ACROSS_EPOCHS)
    trainer.save_model(os.path.join(out, "final"))
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    err = max((p.float() - weights[n].cpu()).abs().max().item() for n, p in loaded.named_parameters())  # loaded on CPU
    assert err == 0, f"ZeRO-{stage}: save_model -> from_pretrained differs from the trained weights by {err:.3e}"
    compare((whole, weights), run_trainer(Trainer, gas, 0.5, **ACROSS_EPOCHS)[:2], f"ZeRO-{stage}, 8 updates")
    for step in (2, 5):
        # The resumed history holds the checkpoint's steps and its own (from scratch it would repeat them).
        resumed = run_trainer(MultiTrainer, gas, 0.5, deepspeed=cfg, out=_shared_tmp(),
                              resume=os.path.join(out, f"checkpoint-{step}"), **ACROSS_EPOCHS)
        compare_bitwise(resumed[:2], (whole, weights), f"ZeRO-{stage} resumed at step {step}")
    return dist.get_rank()


# --------------------------------------------------------------------------------- TRL: DPO
def word_tokenizer():
    """A tokenizer over the tiny Llama's vocabulary, built locally (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_models import VOCAB
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def preference_data(n=32, seed=3):
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(3, 64, (k,), generator=g))
    rows = [{"prompt": words(4), "chosen": words(3), "rejected": words(3)} for _ in range(n)]
    return Dataset.from_list(rows)


def _count_tokens(model):
    """A persistent buffer of ``model`` that each rank's forward passes change with its own data, as
    BatchNorm's running statistics do (it does not enter the outputs)."""
    model.register_buffer("dsm_tokens_seen", torch.zeros(()))

    def count(module, args, kwargs):
        module.dsm_tokens_seen += kwargs.get("input_ids", args[0] if args else None).float().sum()
    model.register_forward_pre_hook(count, with_kwargs=True)


def run_dpo(trainer_cls, gas, deepspeed=None, roles=None, sync=False, lora=False, resume=None, ref_from_policy=True,
            count_tokens=False, **args):
    """``lora``: a LoRA policy (``peft_config``) and no reference model: TRL's reference is the policy
    with its adapters disabled. ``ref_from_policy=False``: the reference starts from other weights.
    ``count_tokens``: the policy gets a per-rank buffer (_count_tokens). ``resume``:
    ``train(resume_from_checkpoint=resume)``; ``args``: more of the DPOConfig."""
    from trl import DPOConfig
    _fresh_process_state()
    policy, reference = causal_lm(), causal_lm()
    if ref_from_policy:
        reference.load_state_dict(policy.state_dict())
    if count_tokens:
        _count_tokens(policy)
    args = _trl_args(DPOConfig, gas, deepspeed, beta=0.5, **args,
                     **(dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5) if sync else {}))
    kw = {} if roles is None else {"deepspeed_roles": roles}
    if lora:
        from peft import LoraConfig
        reference, kw["peft_config"] = None, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=0.0)
    trainer = trainer_cls(model=policy, ref_model=reference, args=args, train_dataset=preference_data(),
                          processing_class=word_tokenizer(), **kw)
    return _train(trainer, resume)


def dpo_vs_ddp(cases=((1, False), (2, False))):
    """DPO with the reference at ZeRO-3 beside a ZeRO-2 policy (deepspeed_roles) against DDP DPO;
    ``cases``: (gas, sync_ref_model: the policy mixed into the reference every 2 steps; gas 1 with it
    runs in dpo_sync_ref_resume, which resumes it too). Then a LoRA policy without a reference model
    (ZeRO-2 and ZeRO-3), as TRL users commonly run DPO."""
    from trl import DPOTrainer

    from deepspeed_multi.transformers import multi_engine_trainer
    upstream = upstream_is_reference()  # TRL's own DeepSpeed path (the reference as TRL prepares it), bit for bit
    for gas, sync in cases:
        want = run_dpo(DPOTrainer, gas, sync=sync, deepspeed=ds_config(2, gas, None) if upstream else None)
        logs, weights, trainer = run_dpo(multi_engine_trainer(DPOTrainer), gas, deepspeed=ds_config(2, gas, None),
                                         roles={"ref_model": {"zero_optimization": {"stage": 3}}}, sync=sync)
        engines = trainer.accelerator.engines()
        stages = sorted((e.has_optimizer, e.zero_optimization_stage()) for e in engines)
        assert stages == [(False, 3), (True, 2)], f"engines held by the Accelerator (trains, stage): {stages}"
        assert trainer.ref_model in engines and trainer.ref_model.zero_optimization_stage() == 3
        _against(upstream, (logs, weights), want,
                 f"DPO gas {gas}{', sync_ref_model' if sync else ''}, policy ZeRO-2, reference ZeRO-3")
    want = None if upstream else run_dpo(DPOTrainer, 1, lora=True)
    for stage in (2, 3):
        if upstream:
            want = run_dpo(DPOTrainer, 1, lora=True, deepspeed=ds_config(stage, 1, None))
        logs, weights, trainer = run_dpo(multi_engine_trainer(DPOTrainer), 1, deepspeed=ds_config(stage, 1, None),
                                         lora=True)
        assert [e.zero_optimization_stage() for e in trainer.accelerator.engines()] == [stage]
        assert any("lora_" in n for n in weights), "no LoRA weights trained"
        # ZeRO-3 sums a LoRA policy's gradient norm in another order than upstream: 4.1e-8 relative (one fp32
        # ulp) on CPU, loss and weights bit-identical.
        _against(upstream, (logs, weights), want, f"DPO with a LoRA policy at ZeRO-{stage}, its adapters off for "
                                                  "reference")
    return dist.get_rank()


DPO_SYNC_SAVE_AT = 3  # past the first sync (step 2), before the next (step 4)


def _dpo_checkpoint(trainer, step=DPO_SYNC_SAVE_AT):
    return os.path.join(trainer.args.output_dir, f"checkpoint-{step}")


def dpo_sync_resume_under_ddp(gas=1):
    """What TRL under DDP does on resume with ``sync_ref_model=True``: the Trainer's checkpoint holds no
    reference, so the resumed run's reference is the one the script builds (the initial policy's
    weights) instead of the synced one. Returns the resumed run's largest difference from the
    uninterrupted run: (final policy weights, final reference weights, logged loss)."""
    from trl import DPOTrainer
    *whole, trainer = run_dpo(DPOTrainer, gas, sync=True, save_strategy="steps", save_steps=DPO_SYNC_SAVE_AT)
    ref = _weights_of(trainer.ref_model)
    *resumed, again = run_dpo(DPOTrainer, gas, sync=True, resume=_dpo_checkpoint(trainer))
    rref = _weights_of(again.ref_model)
    policy = max((resumed[1][n] - whole[1][n]).abs().max().item() for n in whole[1])
    reference = max((rref[n] - ref[n]).abs().max().item() for n in ref)
    loss = max(abs(g["loss"] - w["loss"]) for g, w in zip(resumed[0], whole[0]))
    return policy, reference, loss, [[(h["step"], h["loss"]) for h in logs] for logs in (whole[0], resumed[0])]


def dpo_sync_ref_resume(gas=1):
    """DPO with ``sync_ref_model=True`` (every 2 steps, mixup 0.5), policy ZeRO-2, reference ZeRO-3 via
    deepspeed_roles, a checkpoint every 3 steps: the uninterrupted run matches DDP DPO; its checkpoint at
    step 3 (past the first sync) holds the synced reference, and a run resumed from it in a new trainer
    ends bit-identical to the uninterrupted one (final policy and reference weights, every logged value,
    each rank's policy buffer: _count_tokens), whether the restarted script builds the reference from the
    initial policy, as before, or from other weights. A checkpoint without our folder (an earlier release)
    resumes with a warning, with the reference the script builds, as TRL under DDP resumes (equal to DDP's
    resumed run; the figures: dpo_sync_resume_under_ddp)."""
    import logging
    import shutil

    from trl import DPOTrainer

    from deepspeed_multi.transformers import STATE_DIR, multi_engine_trainer
    cls, cfg = multi_engine_trainer(DPOTrainer), ds_config(2, gas, None)
    roles = {"ref_model": {"zero_optimization": {"stage": 3}}}
    save = dict(save_strategy="steps", save_steps=DPO_SYNC_SAVE_AT, count_tokens=True)
    want = run_dpo(DPOTrainer, gas, sync=True, **save)
    *whole, trainer = run_dpo(cls, gas, deepspeed=cfg, roles=roles, sync=True, **save)
    compare(whole, want[:2], f"DPO gas {gas}, sync_ref_model, policy ZeRO-2, reference ZeRO-3")
    ref = _weights_of(trainer.ref_model)
    seen = trainer.model.dsm_tokens_seen.item()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, seen)
    assert len(set(ranks)) == len(ranks), f"the ranks' policy buffers must differ for the check: {ranks}"
    checkpoint = _dpo_checkpoint(trainer)
    assert sorted(os.listdir(os.path.join(checkpoint, STATE_DIR))) == ["model", "ref_model"], os.listdir(checkpoint)
    for from_policy in (True, False):
        what = f"DPO sync_ref_model resumed at step {DPO_SYNC_SAVE_AT}, the script's reference built from " + \
            ("the initial policy" if from_policy else "other weights")
        *resumed, again = run_dpo(cls, gas, deepspeed=cfg, roles=roles, sync=True, resume=checkpoint,
                                  ref_from_policy=from_policy, **save)
        compare_bitwise(resumed, whole, what)
        # Every logged value; TRL's num_tokens count is not in the Trainer's checkpoint (it restarts, as under DDP).
        logged = [[{k: v for k, v in h.items() if k != "num_tokens"} for h in logs] for logs in (resumed[0], whole[0])]
        assert logged[0] == logged[1], f"{what}: logs differ\n{logged[0]}\n{logged[1]}"
        got = _weights_of(again.ref_model)
        err = max((got[n] - ref[n]).abs().max().item() for n in ref)
        assert err == 0, f"{what}: final reference weights differ from the uninterrupted run's by {err:.3e}"
        assert again.model.dsm_tokens_seen.item() == seen, \
            f"{what}: rank {dist.get_rank()}'s policy buffer {again.model.dsm_tokens_seen.item()}, uninterrupted {seen}"
    older = checkpoint + "-older"
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, older, ignore=shutil.ignore_patterns(STATE_DIR))
    dist.barrier()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("deepspeed_multi.transformers").addHandler(handler)
    try:
        got = run_dpo(cls, gas, deepspeed=cfg, roles=roles, sync=True, resume=older, **save)
    finally:
        logging.getLogger("deepspeed_multi.transformers").removeHandler(handler)
    warned = [r.getMessage() for r in records if STATE_DIR in r.getMessage()]
    assert len(warned) == (dist.get_rank() == 0) and all("['ref_model', 'model']" in w for w in warned), warned
    ddp = run_dpo(DPOTrainer, gas, sync=True, resume=_dpo_checkpoint(want[2]), **save)
    compare(got[:2], ddp[:2], "DPO sync_ref_model resumed from a checkpoint without our folder, vs DDP resumed")
    return dist.get_rank()


# -------------------------------------------------------------------------------- TRL: SFT
def run_sft(trainer_cls, gas, deepspeed=None, packing=False, rows=None, **args):
    """SFT on ``rows`` (a Dataset of texts; short texts of 3-8 words by default); ``args``: more of the SFTConfig."""
    from datasets import Dataset
    from trl import SFTConfig
    _fresh_process_state()
    model = causal_lm()
    if rows is None:
        g = torch.Generator().manual_seed(11)
        lengths = torch.randint(3, 9, (32, ), generator=g)
        rows = Dataset.from_list([{"text": " ".join(f"w{int(i)}" for i in torch.randint(3, 64, (int(k), ),
                                                                                       generator=g))}
                                  for k in lengths])
    args = _trl_args(SFTConfig, gas, deepspeed, max_length=16, packing=packing, **args)
    trainer = trainer_cls(model=model, args=args, train_dataset=rows, processing_class=word_tokenizer())
    return _train(trainer)


def sft_vs_ddp(cases=((2, 2, False), (3, 2, True))):
    """SFTTrainer on short texts against DDP SFT; ``cases``: (stage, gas, packing)."""
    from trl import SFTTrainer

    from deepspeed_multi.transformers import multi_engine_trainer
    upstream = upstream_is_reference()
    for stage, gas, packing in cases:
        want = run_sft(SFTTrainer, gas, packing=packing, deepspeed=ds_config(stage, gas, None) if upstream else None)
        got = run_sft(multi_engine_trainer(SFTTrainer), gas, deepspeed=ds_config(stage, gas, None), packing=packing)
        _against(upstream, got, want, f"SFT ZeRO-{stage} gas {gas}{', packing' if packing else ''}")


# -------------------------------------------------------------------------------- TRL: GRPO
def _prompts(n=16, seed=5):
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": " ".join(f"w{int(i)}" for i in torch.randint(3, 64, (4,), generator=g))}
                              for _ in range(n)])


def _reward_small_ids(completions, **kw):
    """Rewards completions made of small token ids (a smooth, learnable preference)."""
    return [-sum(int(w[1:]) for w in c.split() if w.startswith("w")) / 64.0 for c in completions]


def run_grpo(trainer_cls, gas, policy_dir, deepspeed=None, roles=None, reward_dir=None, config_cls=None):
    from trl import GRPOConfig
    _fresh_process_state()
    args = _trl_args(config_cls or GRPOConfig, gas, deepspeed, per_device_train_batch_size=4, num_generations=4,
                     max_completion_length=4, dataloader_drop_last=False, beta=0.1, temperature=1.0)
    kw = {} if roles is None else {"deepspeed_roles": roles}
    rewards = [_reward_small_ids] + ([reward_dir] if reward_dir else [])
    if reward_dir:
        kw["reward_processing_classes"] = [None, word_tokenizer()]
    trainer = trainer_cls(model=policy_dir, reward_funcs=rewards, args=args, train_dataset=_prompts(),
                          processing_class=word_tokenizer(), **kw)
    return _train(trainer)


def _saved_policy_and_reward():
    root = _shared_tmp()
    policy_dir, reward_dir = os.path.join(root, "policy"), os.path.join(root, "reward")
    if dist.get_rank() == 0:
        from hf_models import scorer
        torch.manual_seed(0)
        causal_lm().save_pretrained(policy_dir)
        scorer().save_pretrained(reward_dir)
    dist.barrier()
    return policy_dir, reward_dir


def grpo_vs_ddp(cases=((2, 1, True), (3, 2, False)), trainer="GRPO"):
    """GRPO or RLOO (generation, a reference for the KL term at ZeRO-3 via deepspeed_roles, optionally
    a reward model at ZeRO-3 too) against the same TRL trainer under DDP; ``cases``: (policy stage,
    gas, with a reward model)."""
    import trl

    from deepspeed_multi.transformers import multi_engine_trainer
    trainer_cls, config_cls = getattr(trl, f"{trainer}Trainer"), getattr(trl, f"{trainer}Config")
    policy_dir, reward_dir = _saved_policy_and_reward()
    z3 = {"zero_optimization": {"stage": 3}}
    upstream = upstream_is_reference()
    for stage, gas, reward_model in cases:
        reward = reward_dir if reward_model else None
        want = run_grpo(trainer_cls, gas, policy_dir, reward_dir=reward, config_cls=config_cls,
                        deepspeed=ds_config(stage, gas, None) if upstream else None)
        roles = {"ref_model": z3, **({"reward_funcs": z3} if reward_model else {})}
        logs, weights, built = run_grpo(multi_engine_trainer(trainer_cls), gas, policy_dir,
                                        deepspeed=ds_config(stage, gas, None), roles=roles, reward_dir=reward,
                                        config_cls=config_cls)
        stages = sorted((e.has_optimizer, e.zero_optimization_stage()) for e in built.accelerator.engines())
        assert stages == [(False, 3)] * (1 + reward_model) + [(True, stage)], \
            f"{trainer}: engines held by the Accelerator (trains, stage): {stages}"
        _against(upstream, (logs, weights), want, f"{trainer} gas {gas}, policy ZeRO-{stage}, reference ZeRO-3"
                                                  f"{', reward model ZeRO-3' if reward_model else ''}")
    return dist.get_rank()


# ------------------------------------------------------------------------- TRL: distillation
def run_distillation(trainer_cls, gas, policy_dir, teacher_dir, deepspeed=None, roles=None):
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig
    _fresh_process_state()
    args = _trl_args(DistillationConfig, gas, deepspeed, per_device_train_batch_size=4, max_completion_length=4,
                     dataloader_drop_last=False, temperature=1.0)
    kw = {} if roles is None else {"deepspeed_roles": roles}
    trainer = trainer_cls(model=policy_dir, teacher_model=AutoModelForCausalLM.from_pretrained(teacher_dir),
                          args=args, train_dataset=_prompts(32), processing_class=word_tokenizer(), **kw)
    return _train(trainer)


def distillation_vs_ddp(cases=((2, 1), (2, 2))):
    """TRL's DistillationTrainer (on-policy generation, the teacher's distribution as target) with the
    teacher at ZeRO-3 via deepspeed_roles, against DDP; ``cases``: (student stage, gas)."""
    from trl import DistillationTrainer

    from deepspeed_multi.transformers import multi_engine_trainer
    policy_dir, _ = _saved_policy_and_reward()
    teacher_dir = os.path.join(os.path.dirname(policy_dir), "teacher")
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        causal_lm().save_pretrained(teacher_dir)
    dist.barrier()
    upstream = upstream_is_reference()
    for stage, gas in cases:
        want = run_distillation(DistillationTrainer, gas, policy_dir, teacher_dir,
                                deepspeed=ds_config(stage, gas, None) if upstream else None)
        logs, weights, built = run_distillation(multi_engine_trainer(DistillationTrainer), gas, policy_dir,
                                                teacher_dir, deepspeed=ds_config(stage, gas, None),
                                                roles={"teacher_model": {"zero_optimization": {"stage": 3}}})
        stages = sorted((e.has_optimizer, e.zero_optimization_stage()) for e in built.accelerator.engines())
        assert stages == [(False, 3), (True, stage)], f"distillation: engines (trains, stage): {stages}"
        assert built.teacher_model.zero_optimization_stage() == 3
        _against(upstream, (logs, weights), want, f"distillation gas {gas}, student ZeRO-{stage}, teacher ZeRO-3")
    return dist.get_rank()


# ------------------------------------------------------------------------- TRL: online DPO
def run_online_dpo(trainer_cls, gas, policy_dir, reward_dir, deepspeed=None, roles=None):
    from transformers import AutoModelForCausalLM
    from trl.experimental.online_dpo import OnlineDPOConfig
    _fresh_process_state()
    args = _trl_args(OnlineDPOConfig, gas, deepspeed, per_device_train_batch_size=4, max_new_tokens=4,
                     dataloader_drop_last=False, temperature=1.0, beta=[0.1])
    kw = {} if roles is None else {"deepspeed_roles": roles}
    trainer = trainer_cls(model=policy_dir, ref_model=AutoModelForCausalLM.from_pretrained(policy_dir),
                          reward_funcs=[reward_dir], args=args, train_dataset=_prompts(32),
                          processing_class=word_tokenizer(), reward_processing_classes=[word_tokenizer()], **kw)
    return _train(trainer)


def online_dpo_vs_ddp(cases=((2, 1), (2, 2))):
    """TRL's (experimental) OnlineDPOTrainer: generation, a reward model and the reference at ZeRO-3 via
    deepspeed_roles, against DDP; ``cases``: (policy stage, gas)."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    from deepspeed_multi.transformers import multi_engine_trainer
    policy_dir, reward_dir = _saved_policy_and_reward()
    z3 = {"zero_optimization": {"stage": 3}}
    for stage, gas in cases:
        # Upstream is the reference at gas 1 only: under DeepSpeed at gas 2 TRL's OnlineDPOTrainer logs half
        # DDP's (and our) gradient norm (CPU, step 1: 0.2628 against 0.5256), the loss divided by the
        # accumulation twice (by the trainer, then by engine.backward); DDP stays the reference there.
        upstream = upstream_is_reference() and gas == 1
        want = run_online_dpo(OnlineDPOTrainer, gas, policy_dir, reward_dir,
                              deepspeed=ds_config(stage, gas, None) if upstream else None)
        logs, weights, built = run_online_dpo(multi_engine_trainer(OnlineDPOTrainer), gas, policy_dir, reward_dir,
                                              deepspeed=ds_config(stage, gas, None),
                                              roles={"ref_model": z3, "reward_funcs": z3})
        stages = sorted((e.has_optimizer, e.zero_optimization_stage()) for e in built.accelerator.engines())
        assert stages == [(False, 3), (False, 3), (True, stage)], f"online DPO: engines (trains, stage): {stages}"
        _against(upstream, (logs, weights), want,
                 f"online DPO gas {gas}, policy ZeRO-{stage}, reference and reward ZeRO-3")
    return dist.get_rank()


# ------------------------------------------------------------------------------- TRL: GKD
def _chats(n=32, seed=9):
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(3, 64, (k,), generator=g))
    return Dataset.from_list([{"messages": [{"role": "user", "content": words(4)},
                                            {"role": "assistant", "content": words(3)}]} for _ in range(n)])


def run_gkd(trainer_cls, gas, policy_dir, teacher_dir, deepspeed=None, roles=None):
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig
    _fresh_process_state()
    tok = word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    args = _trl_args(GKDConfig, gas, deepspeed, per_device_train_batch_size=4, max_new_tokens=4, max_length=16,
                     dataloader_drop_last=False, temperature=1.0, lmbda=0.5)
    kw = {} if roles is None else {"deepspeed_roles": roles}
    trainer = trainer_cls(model=policy_dir, teacher_model=AutoModelForCausalLM.from_pretrained(teacher_dir), args=args,
                          train_dataset=_chats(), processing_class=tok, **kw)
    return _train(trainer)


def gkd_vs_ddp(cases=((2, 1), (2, 2))):
    """TRL's (experimental) GKDTrainer (on-policy half the time) with the teacher at ZeRO-3 via
    deepspeed_roles, against DDP; ``cases``: (student stage, gas)."""
    from trl.experimental.gkd import GKDTrainer

    from deepspeed_multi.transformers import multi_engine_trainer
    policy_dir, _ = _saved_policy_and_reward()
    teacher_dir = os.path.join(os.path.dirname(policy_dir), "teacher")
    if dist.get_rank() == 0 and not os.path.isdir(teacher_dir):
        torch.manual_seed(1)
        causal_lm().save_pretrained(teacher_dir)
    dist.barrier()
    upstream = upstream_is_reference()
    for stage, gas in cases:
        want = run_gkd(GKDTrainer, gas, policy_dir, teacher_dir,
                       deepspeed=ds_config(stage, gas, None) if upstream else None)
        logs, weights, built = run_gkd(multi_engine_trainer(GKDTrainer), gas, policy_dir, teacher_dir,
                                       deepspeed=ds_config(stage, gas, None),
                                       roles={"teacher_model": {"zero_optimization": {"stage": 3}}})
        stages = sorted((e.has_optimizer, e.zero_optimization_stage()) for e in built.accelerator.engines())
        assert stages == [(False, 3), (True, stage)], f"GKD: engines (trains, stage): {stages}"
        _against(upstream, (logs, weights), want, f"GKD gas {gas}, student ZeRO-{stage}, teacher ZeRO-3")
    return dist.get_rank()


# ------------------------------------------------------------------------- fp16 skipped updates
def fp16_skipped_steps(stage=2, gas=1):
    """fp16 with an initial loss scale that overflows: at every Trainer step,
    ``accelerator.optimizer_step_was_skipped`` is true exactly when the engine skipped its update
    (its ``skipped_steps`` grew), and the learning-rate schedule advances on applied updates only
    (what a DDP Trainer does with a GradScaler; on CPU Accelerate runs fp16 with no GradScaler, so
    a DDP run cannot skip here and the check is against the engine's own record)."""
    from transformers import TrainerCallback

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    lr0 = 2e-2
    cfg = ds_config(stage, gas, None)
    cfg["fp16"] = {"enabled": "auto", "initial_scale_power": 18, "loss_scale_window": 1000, "hysteresis": 1,
                   "min_loss_scale": 1}
    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            engine = trainer.accelerator.engines()[0]
            seen.append((trainer.accelerator.optimizer_step_was_skipped, engine.skipped_steps, engine.global_steps))

    _fresh_process_state()
    trainer = MultiTrainer(model=causal_lm(), args=_args(_shared_tmp(), gas, 0.5, copy.deepcopy(cfg), fp16=True,
                                                        learning_rate=lr0),
                           train_dataset=TokenData(), callbacks=[Record()])
    logs, _, _ = _train(trainer)
    flags = [s[0] for s in seen]
    skipped = [s[1] for s in seen]
    grew = [b > a for a, b in zip([0] + skipped, skipped)]
    assert flags == grew, f"ZeRO-{stage} fp16: optimizer_step_was_skipped {flags}, engine skipped an update {grew}"
    assert any(flags) and not all(flags), f"ZeRO-{stage} fp16: the run must hold skipped and applied updates: {flags}"
    total = len(seen)
    applied_before = [sum(not f for f in flags[:i]) for i in range(total)]
    for log, k in zip(logs, applied_before):
        want = lr0 * (1 - k / total)
        assert abs(log["learning_rate"] - want) <= 1e-9, \
            f"ZeRO-{stage} fp16 step {log['step']}: learning rate {log['learning_rate']} after {k} applied updates, " \
            f"the schedule gives {want} (it must not advance on a skipped update)"
    assert seen[-1][2] - seen[-1][1] == total - sum(flags), seen[-1]
    return flags


def fp16_skips_like_upstream(stage=2, gas=1, scale_power=24):
    """fp16 on a GPU: the same job under our Trainer and under the plain Transformers Trainer with upstream
    DeepSpeed (``TrainingArguments(deepspeed=cfg)``), both from a loss scale of 2**scale_power that overflows
    for the first updates: at every step ``optimizer_step_was_skipped``, the loss, the gradient norm and
    the learning rate are bit-identical (deterministic kernels: benchmarks/run_gpu.sh sets them).

    Upstream, not DDP, is the reference (upstream_is_reference): a DDP Trainer keeps fp32 weights under
    autocast with a GradScaler, DeepSpeed 16-bit weights, so they overflow on different steps by
    construction (measured on an H200, ZeRO-2 gas 1 from 2**24: ours and upstream skip updates 1-7, 11
    and 16, the DDP Trainer 1-7). Both use the unfused AdamW (``optim="adamw_torch"``), as the DDP check did."""
    from transformers import Trainer, TrainerCallback

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    cfg = ds_config(stage, gas, None)
    cfg["fp16"] = {"enabled": "auto", "initial_scale_power": scale_power, "loss_scale_window": 2000,
                   "hysteresis": 1, "min_loss_scale": 1}
    runs = {}
    for name, cls in (("ours", MultiTrainer), ("upstream", Trainer)):
        seen = []

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                seen.append(trainer.accelerator.optimizer_step_was_skipped)

        _fresh_process_state()
        trainer = cls(model=causal_lm(), args=_args(_shared_tmp(), gas, 0.5, copy.deepcopy(cfg), fp16=True,
                                                   optim="adamw_torch"),
                      train_dataset=TokenData(), callbacks=[Record()])
        logs, weights, _ = _train(trainer)
        runs[name] = (seen, logs, weights)
    (ours, ours_logs, ours_w), (up, up_logs, up_w) = runs["ours"], runs["upstream"]
    what = f"ZeRO-{stage} gas {gas} fp16 from scale 2**{scale_power}"
    assert any(up) and not all(up), f"{what}: the upstream run must hold skipped and applied updates: {up}"
    assert ours == up, f"{what}: skipped updates differ\n ours     {ours}\n upstream {up}"
    compare_bitwise((ours_logs, ours_w), (up_logs, up_w), f"{what}, against upstream")
    return ours
