"""transformers.Trainer on MultiEngines against the same job under a DDP Trainer (rank functions).

Each job: a tiny Llama built from a config (the same starting weights for both), an in-memory
dataset of random token ids, 2 CPU ranks, AdamW with a linear schedule, ``max_grad_norm`` on.
The DDP Trainer is the reference: logged losses, ``grad_norm`` and learning rates, and the final
weights must match to 1e-5 (fp32).
"""
import copy
import os
import tempfile

import torch

import deepspeed.comm as dist

from common import FP32_TOL
from hf_common import reset_accelerate
from hf_models import causal_lm, tokens

SEQ, MICRO_BS, SAMPLES = 8, 2, 40


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n=SAMPLES, seed=7):
        g = torch.Generator().manual_seed(seed)
        self.ids = tokens(g, n, SEQ)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(stage, gas, clip):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto" if clip is None else clip, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _args(out, gas, max_grad_norm, deepspeed=None, **kw):
    from transformers import TrainingArguments
    args = dict(output_dir=out, per_device_train_batch_size=MICRO_BS, gradient_accumulation_steps=gas,
                learning_rate=2e-2, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=max_grad_norm,
                num_train_epochs=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                data_seed=0, dataloader_drop_last=True, disable_tqdm=True, deepspeed=deepspeed)
    args.update(kw)
    return TrainingArguments(**args)


def _clear_ds_env():
    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        os.environ.pop(key, None)


def run_trainer(trainer_cls, gas, max_grad_norm, deepspeed=None, out=None, loss_kwargs=True, resume=None,
                **args):
    """Train once; return (log history of the training steps, final full weights by name, trainer).

    ``loss_kwargs=False``: the Trainer divides each micro-batch's loss by its accumulation count
    (a model that takes no ``num_items_in_batch``) instead of normalizing by the window's tokens.
    """
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    reset_accelerate()
    _clear_ds_env()
    torch.manual_seed(0)
    model = causal_lm()
    out = out or _shared_tmp()
    trainer = trainer_cls(model=model, args=_args(out, gas, max_grad_norm, copy.deepcopy(deepspeed), **args),
                          train_dataset=TokenData())
    if not loss_kwargs:
        trainer.model_accepts_loss_kwargs = False
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    weights = _full_weights(trainer)
    if deepspeed is not None:
        engines = trainer.accelerator.engines()
        assert len(engines) == 1 and engines[0].zero_optimization_stage() == deepspeed["zero_optimization"]["stage"]
    unset_hf_deepspeed_config()
    _clear_ds_env()
    return logs, weights, trainer


def _shared_tmp():
    """One directory for every rank (rank 0 makes it)."""
    holder = [tempfile.mkdtemp(prefix="dsm_trainer_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _full_weights(trainer):
    import deepspeed
    model = trainer.model_wrapped
    module = getattr(model, "module", model)
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().clone().float() for n, p in params.items()}


def compare(got, want, what):
    (glogs, gweights), (wlogs, wweights) = got, want
    assert len(glogs) == len(wlogs) and len(wlogs) >= 2, f"{what}: {len(glogs)} logged steps, DDP {len(wlogs)}"
    for g, w in zip(glogs, wlogs):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert abs(g[key] - w[key]) <= FP32_TOL * max(1.0, abs(w[key])), \
                f"{what}: step {w['step']} {key} {g[key]!r} vs DDP {w[key]!r}"
    err = max((gweights[n] - wweights[n]).abs().max().item() for n in wweights)
    assert err <= FP32_TOL, f"{what}: final weights differ from DDP's by {err:.3e}"


def trainer_vs_ddp(cases):
    """``cases``: (stage, gas, max_grad_norm, loss_kwargs) each; ours vs a DDP Trainer on the same job."""
    from transformers import Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    refs = {}
    for stage, gas, max_grad_norm, loss_kwargs in cases:
        key = (gas, max_grad_norm, loss_kwargs)
        if key not in refs:
            logs, weights, _ = run_trainer(Trainer, gas, max_grad_norm, loss_kwargs=loss_kwargs)
            refs[key] = (logs, weights)
        logs, weights, _ = run_trainer(MultiTrainer, gas, max_grad_norm, deepspeed=ds_config(stage, gas, None),
                                       loss_kwargs=loss_kwargs)
        compare((logs, weights), refs[key], f"ZeRO-{stage} gas {gas} max_grad_norm {max_grad_norm} "
                                            f"{'token-normalized' if loss_kwargs else 'divided by gas'}")
    _scale_wrt_gas_refused_outside_trainer()
    try:
        run_trainer(MultiTrainer, 1, 0.5, deepspeed=ds_config(0, 1, None))
    except ValueError as e:
        assert "ZeRO stage 0" in str(e) and "LlamaForCausalLM" in str(e), e
    else:
        raise AssertionError("a ZeRO-0 engine under the Trainer was accepted")
    return dist.get_rank()


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
    """Trainer's save_steps checkpoint, then resume_from_checkpoint in a new Trainer: the same logged
    losses and final weights as the uninterrupted run; save_model -> from_pretrained gives the trained weights."""
    from transformers import AutoModelForCausalLM

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    cfg = ds_config(stage, gas, None)
    # As under upstream DeepSpeed: without this key a ZeRO-3 save_model writes a DeepSpeed checkpoint only.
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    out = _shared_tmp()
    whole, weights, trainer = run_trainer(MultiTrainer, gas, 0.5, deepspeed=cfg, out=out, save_strategy="steps",
                                          save_steps=2)
    trainer.save_model(os.path.join(out, "final"))
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    err = max((p.float() - weights[n]).abs().max().item() for n, p in loaded.named_parameters())
    assert err == 0, f"ZeRO-{stage}: save_model -> from_pretrained differs from the trained weights by {err:.3e}"
    resumed, rweights, _ = run_trainer(MultiTrainer, gas, 0.5, deepspeed=cfg, out=out,
                                       resume=os.path.join(out, "checkpoint-2"))
    # The resumed history holds the checkpoint's steps 1-2 and its own 3-5 (from scratch it would hold 1-2 twice).
    assert [h["step"] for h in resumed] == [h["step"] for h in whole], (resumed, whole)
    compare((resumed, rweights), (whole, weights), f"ZeRO-{stage} resumed at step 2")
    return dist.get_rank()
