"""The stock ``transformers.Trainer`` and TRL's trainers, unchanged, with ``deepspeed.initialize`` swapped for ours,
against the same job on upstream DeepSpeed (rank functions for test_trainer_drop_in.py).

Nothing of ours is subclassed or imported by the program: Accelerate's ``prepare`` calls ``deepspeed.initialize``,
which is ours for one run and upstream's for the other. Compared bit for bit: every logged loss, grad_norm and
learning rate, the final weights, and the last checkpoint the Trainer saved, file by file (``trainer_state.json``,
the saved model with its keys, DeepSpeed's model and optimizer states with the fp32 masters and Adam moments, the
RNG states, the scheduler).
"""
import contextlib
import copy
import json
import os

import numpy as np
import torch

import deepspeed
import deepspeed.comm as dist

import deepspeed_multi
import trainer_checks as tc
from drop_in import initialize_swapped, launcher_env
from hf_models import causal_lm

STEPS = 4


def _engine_class_is(trainer, ours: bool):
    engine = trainer.model_wrapped
    assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
    assert isinstance(engine, deepspeed_multi.MultiEngine) == ours, f"ours={ours}: built {type(engine).__name__}"


def _same(got, want, where):
    """Nested checkpoint contents equal: tensors bit for bit (dtype and shape too), objects by their fields,
    everything else by ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), \
            f"{where}: differs from upstream by {(got.double() - want.double()).abs().max().item():.3e}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), \
            f"{where}: keys {sorted(map(str, got))} vs upstream {sorted(map(str, want))}"
        for key in want:
            _same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got!r} vs upstream {want!r}"
        for j, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{j}]")
    elif isinstance(want, np.ndarray):  # (numpy's RNG state)
        assert isinstance(got, np.ndarray) and np.array_equal(got, want), f"{where}: differs from upstream"
    elif hasattr(want, "__dict__") and not isinstance(want, type):  # (a loss scaler object: its fields)
        assert type(got) is type(want), f"{where}: {type(got).__name__} vs upstream {type(want).__name__}"
        _same(vars(got), vars(want), where)
    else:
        same = got == want or (got != got and want != want)  # (nan)
        assert same, f"{where}: {got!r} vs upstream {want!r}"


# Files that hold the run's own paths or its wall-clock, not its state.
_NOT_STATE = {"training_args.bin"}
# Keys of DeepSpeed's states that name the run's paths, world or release, not its training.
_NOT_STATE_KEYS = {"ds_config", "ds_version", "buffer_names", "param_shapes", "frozen_param_shapes",
                   "shared_params", "frozen_param_fragments"}


def _load(path):
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    if path.endswith((".pt", ".pth", ".bin")):
        found = torch.load(path, map_location="cpu", weights_only=False)
        return {k: v for k, v in found.items() if k not in _NOT_STATE_KEYS} if isinstance(found, dict) else found
    with open(path, "rb") as f:
        return f.read()


def checkpoint_files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
                  if f not in _NOT_STATE)


def compare_checkpoints(got_dir, want_dir, what):
    """Every file of upstream's last checkpoint is in ours, with the same contents (see ``_same``)."""
    got_files, want_files = checkpoint_files(got_dir), checkpoint_files(want_dir)
    assert got_files == want_files, f"{what}: checkpoint files {got_files} vs upstream {want_files}"
    for name in want_files:
        _same(_load(os.path.join(got_dir, name)), _load(os.path.join(want_dir, name)), f"{what}: {name}")


def run_stock(ours, config, gas=2, bf16=False, trainer_cls=None, **args):
    """The stock Trainer on the tiny tied-embedding Llama, ``STEPS`` updates, the last one saved as a checkpoint."""
    from transformers import Trainer
    torch.manual_seed(0)  # the same starting weights on both sides
    with initialize_swapped(ours):
        logs, weights, trainer = tc.run_trainer(
            trainer_cls or Trainer, gas, 0.5, deepspeed=config, bf16=bf16, max_steps=STEPS, save_strategy="steps",
            save_steps=STEPS, model=causal_lm(tie_word_embeddings=True), **args)
    _engine_class_is(trainer, ours)
    return logs, weights, os.path.join(trainer.args.output_dir, f"checkpoint-{STEPS}")


def stock_trainer_as_upstream(cases):
    """``cases``: (stage, bf16, gas); the stock Trainer through ours and through upstream, bit for bit."""
    for stage, bf16, gas in cases:
        config = tc.ds_config(stage, gas, None)
        if bf16:
            config = dict(config, bf16={"enabled": "auto"})
        what = f"stock Trainer ZeRO-{stage} {'bf16' if bf16 else 'fp32'} gas {gas}"
        want = run_stock(False, copy.deepcopy(config), gas, bf16)
        got = run_stock(True, copy.deepcopy(config), gas, bf16)
        tc.compare_bitwise(got[:2], want[:2], f"{what}, against upstream")
        dist.barrier()
        compare_checkpoints(got[2], want[2], what)
    return len(cases)


def _teacher_dir(policy_dir):
    teacher_dir = os.path.join(os.path.dirname(policy_dir), "teacher")
    if dist.get_rank() == 0:
        torch.manual_seed(1)
        causal_lm().save_pretrained(teacher_dir)
    dist.barrier()
    return teacher_dir


def _trl_run(name, stage, gas, dirs, bf16):
    """One TRL trainer, stock, on the job trainer_checks.py runs it on; its reference, reward or teacher model
    prepared by TRL itself (through ``deepspeed.initialize`` where TRL wraps it in an engine)."""
    import trl
    config = tc.ds_config(stage, gas, None)
    if bf16:
        config["bf16"] = {"enabled": "auto"}
    policy_dir, reward_dir, teacher_dir = dirs
    if name == "SFT":
        return tc.run_sft(trl.SFTTrainer, gas, deepspeed=config)
    if name == "DPO":
        return tc.run_dpo(trl.DPOTrainer, gas, deepspeed=config)
    if name in ("GRPO", "RLOO"):
        return tc.run_grpo(getattr(trl, f"{name}Trainer"), gas, policy_dir, deepspeed=config, reward_dir=reward_dir,
                           config_cls=getattr(trl, f"{name}Config"))
    if name == "Distillation":
        return tc.run_distillation(trl.DistillationTrainer, gas, policy_dir, teacher_dir, deepspeed=config)
    if name == "OnlineDPO":
        from trl.experimental.online_dpo import OnlineDPOTrainer
        return tc.run_online_dpo(OnlineDPOTrainer, gas, policy_dir, reward_dir, deepspeed=config)
    if name == "GKD":
        from trl.experimental.gkd import GKDTrainer
        return tc.run_gkd(GKDTrainer, gas, policy_dir, teacher_dir, deepspeed=config)
    raise ValueError(name)


def trl_trainers_as_upstream(cases):
    """``cases``: (TRL trainer, stage, gas, dtype); each stock TRL trainer through ours and through upstream, bit for
    bit (every logged loss, grad_norm and learning rate, the final weights), ours asserted to have built ours."""
    policy_dir, reward_dir = tc._saved_policy_and_reward()
    dirs = (policy_dir, reward_dir, _teacher_dir(policy_dir))
    for name, stage, gas, dtype in cases:
        runs = {}
        for ours in (False, True):
            with initialize_swapped(ours), (tc.trl_in_bf16() if dtype == "bf16" else contextlib.nullcontext()):
                runs[ours] = _trl_run(name, stage, gas, dirs, dtype == "bf16")
            _engine_class_is(runs[ours][2], ours)
        tc.compare_bitwise(runs[True][:2], runs[False][:2],
                           f"TRL {name}Trainer ZeRO-{stage} {dtype} gas {gas}, against upstream")
    return len(cases)


def _saved(trainer, name):
    """``trainer.save_model`` into a fresh folder: (the saved file's keys, the model from_pretrained reads back)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    folder = os.path.join(trainer.args.output_dir, name)
    trainer.save_model(folder)
    dist.barrier()
    keys = sorted(load_file(os.path.join(folder, "model.safetensors")))
    return keys, AutoModelForCausalLM.from_pretrained(folder)


def saved_models_as_upstream(stages=(2, 3)):
    """A tied-embedding model saved by our Trainer, by a TRL trainer built by ``multi_engine_trainer`` with a role at
    ZeRO-3, and by the stock Trainer through ours, holds the keys upstream's stock Trainer saves (the tied weight
    once where upstream saves it once: at ZeRO-3 gathered on save), reads back with ``from_pretrained`` tied, and
    (the drop-in) holds upstream's values."""
    import trl
    from transformers import Trainer

    from deepspeed_multi.transformers import Trainer as MultiTrainer
    from deepspeed_multi.transformers import multi_engine_trainer
    for stage in stages:
        config = tc.ds_config(stage, 2, None)
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        saved = {}
        for name, cls, ours in (("upstream", Trainer, False), ("drop-in", Trainer, True), ("ours", MultiTrainer, True)):
            torch.manual_seed(0)
            with initialize_swapped(ours and cls is Trainer):
                trainer = tc.run_trainer(cls, 2, 0.5, deepspeed=copy.deepcopy(config), max_steps=2,
                                         model=causal_lm(tie_word_embeddings=True))[2]
            saved[name] = _saved(trainer, f"saved-{name}")
        tied = tc.causal_lm
        tc.causal_lm = lambda **kw: tied(tie_word_embeddings=True, **kw)
        try:
            for name, cls, roles in (("DPO upstream", trl.DPOTrainer, None),
                                     ("DPO roles", multi_engine_trainer(trl.DPOTrainer),
                                      {"ref_model": {"zero_optimization": {"stage": 3}}})):
                trainer = tc.run_dpo(cls, 2, deepspeed=copy.deepcopy(config), roles=roles, max_steps=2)[2]
                saved[name] = _saved(trainer, f"saved-{name.replace(' ', '-')}")
        finally:
            tc.causal_lm = tied
        for name, want in (("drop-in", "upstream"), ("ours", "upstream"), ("DPO roles", "DPO upstream")):
            assert saved[name][0] == saved[want][0], \
                f"ZeRO-{stage}: {name} saved keys {saved[name][0]}, {want} {saved[want][0]}"
        for name, (_, model) in saved.items():
            assert model.lm_head.weight is model.model.embed_tokens.weight, f"ZeRO-{stage} {name}: read back untied"
        got, want = saved["drop-in"][1].state_dict(), saved["upstream"][1].state_dict()
        _same(got, want, f"ZeRO-{stage}: the drop-in's saved model")
    return len(stages)


@contextlib.contextmanager
def launched_by(yaml_name):
    """Every Trainer run inside as launched by ``accelerate launch`` with TRL's shipped ``yaml_name``."""
    import trl
    yaml_path = os.path.join(os.path.dirname(trl.__file__), "accelerate_configs", yaml_name)
    tc.LAUNCH_ENV.update(launcher_env(yaml_path, mixed_precision="no"))
    assert tc.LAUNCH_ENV["ACCELERATE_USE_DEEPSPEED"] == "true" and "ACCELERATE_CONFIG_DS_FIELDS" in tc.LAUNCH_ENV
    try:
        yield
    finally:
        tc._clear_ds_env()
        tc.LAUNCH_ENV.clear()


def roles_under_accelerate_launch():
    """multi_engine_trainer + deepspeed_roles under ``accelerate launch --config_file <TRL's zeroN.yaml>``: the
    launcher's settings are the policy's, each role's config its own; DPO (zero2.yaml, gas 2) and distillation
    (zero1.yaml, gas 1) with the reference / teacher at ZeRO-3, against the same TRL trainer under DDP (fp32)."""
    import trl

    from deepspeed_multi.transformers import multi_engine_trainer
    z3 = {"zero_optimization": {"stage": 3}}
    policy_dir, _ = tc._saved_policy_and_reward()
    teacher_dir = _teacher_dir(policy_dir)
    jobs = [("DPO", "zero2.yaml", 2, lambda cls, **kw: tc.run_dpo(cls, 2, **kw), "ref_model", 2),
            ("distillation", "zero1.yaml", 1,
             lambda cls, **kw: tc.run_distillation(cls, 1, policy_dir, teacher_dir, **kw), "teacher_model", 1)]
    for name, yaml_name, stage, run, role, gas in jobs:
        cls = trl.DPOTrainer if name == "DPO" else trl.DistillationTrainer
        want = run(cls)
        with launched_by(yaml_name):
            logs, weights, built = run(multi_engine_trainer(cls), roles={role: z3})
        stages = sorted((e.has_optimizer, e.zero_optimization_stage()) for e in built.accelerator.engines())
        assert stages == [(False, 3), (True, stage)], f"{name} under accelerate launch: engines {stages}"
        tc.compare((logs, weights), want[:2], f"{name} under accelerate launch --config_file {yaml_name}")
    return len(jobs)
