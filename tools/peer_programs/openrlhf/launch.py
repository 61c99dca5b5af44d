"""One rank of an OpenRLHF CLI run: apply the environment shims, install the recorders, then run
the CLI module unchanged with ``runpy``.

    python launch.py --module openrlhf.cli.train_dpo --record DIR [--one-backward] [--fp32] -- <CLI args>

(run.py starts it under torchrun, on both sides.) OpenRLHF's code is never edited: everything here
is a patch applied in this process before the module runs, and every patch prints one line
(``[openrlhf-shim] ...``) the first time it acts, so a run's output shows what it needed.

Shims (both sides; none changes the arithmetic):
  * CUDA-only calls on a CPU-only torch: ``torch.cuda.set_device`` and ``torch.cuda.synchronize``
    do nothing, ``torch.cuda.current_device()`` names the CPU (OpenRLHF's all_reduce/all_gather move
    logged scalars there), ``init_device_mesh("cuda", ...)`` builds the mesh on "cpu" (gloo).
  * ``flash_attn``: openrlhf.models.ring_attn_utils imports flash_attn.bert_padding and
    flash_attn.utils.distributed at module level (only packing/ring attention calls them). Stand-in
    modules let the import succeed; calling any of their functions raises.
  * transformers 5.24 (OpenRLHF 0.11.0 pins 5.15): OpenRLHF's own ZeRO-3 loading patch
    (``openrlhf.models.actor._patch_zero3_weight_mapping``) expects a dict where 5.24 returns a
    generator of dicts; adapters on both sides of it (see shim_zero3_weight_mapping).

Recorders (both sides):
  * the dict each trainer passes to its log call (``save_logs_and_checkpoints``, once per optimizer
    step, already all-reduced by OpenRLHF) -> DIR/logs.jsonl, rank 0;
  * the trained engine's fp32 master weights (``deepspeed.utils.safe_get_full_fp32_param``, all
    ranks take part since ZeRO-3 gathers) just before OpenRLHF's final ``save_model`` ->
    DIR/master_fp32.pt, rank 0. OpenRLHF's own saved model (bf16 under bf16) is compared too;
  * each config OpenRLHF passes to ``deepspeed.initialize`` -> DIR/ds_configs.json, rank 0.

Variants:
  * ``--one-backward`` (DPO, ours only): the DPO trainer's ``self.strategy.backward(loss, model,
    optimizer)`` (which is ``model.backward(loss)``) becomes plain ``loss.backward()``: deepspeed_multi
    runs the engine's backward prologue/epilogue (and the 1/gradient_accumulation_steps scaling) from
    autograd hooks, so no engine.backward call is needed.
  * ``--fp32``: OpenRLHF only offers bf16/fp16 (``--ds.param_dtype``); this loads the models in
    float32 and turns DeepSpeed's bf16 section off in the configs OpenRLHF builds. A program variant
    applied alike on both sides, not an environment shim.
"""
import argparse
import functools
import importlib.machinery
import json
import os
import runpy
import sys
import types


def say(what):
    print(f"[openrlhf-shim] {what}", flush=True)


def once(what):
    """Decorator: print ``what`` the first time the wrapped function runs."""
    def wrap(fn):
        done = []

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not done:
                done.append(True)
                say(what)
            return fn(*args, **kwargs)
        return inner
    return wrap


def rank():
    return int(os.environ.get("RANK", "0"))


# ----------------------------------------------------------------------------------------------
# Environment shims
# ----------------------------------------------------------------------------------------------

def shim_cuda():
    import torch
    import torch.distributed.device_mesh as device_mesh
    if torch.cuda.is_available():
        return  # a real GPU: nothing to shim

    torch.cuda.set_device = once("torch.cuda.set_device(...) on CPU: no-op")(lambda *a, **k: None)
    torch.cuda.synchronize = once("torch.cuda.synchronize() on CPU: no-op")(lambda *a, **k: None)
    torch.cuda.current_device = once("torch.cuda.current_device() on CPU: 'cpu'")(lambda: "cpu")

    upstream_mesh = device_mesh.init_device_mesh

    @once('init_device_mesh("cuda", ...) on CPU: built on "cpu"')
    def cpu_mesh(device_type, *args, **kwargs):
        return upstream_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    def init_device_mesh(device_type, *args, **kwargs):
        if device_type == "cuda":
            return cpu_mesh(device_type, *args, **kwargs)
        return upstream_mesh(device_type, *args, **kwargs)

    # openrlhf.utils.deepspeed.deepspeed binds the name at import (it has not been imported yet).
    device_mesh.init_device_mesh = init_device_mesh


def shim_flash_attn():
    try:
        import flash_attn  # noqa: F401  (installed: use it)
        return
    except ImportError:
        pass
    import einops

    def missing(name):
        def fn(*args, **kwargs):
            raise RuntimeError(f"flash_attn.{name} is a stand-in (flash-attn is not installed): "
                               "packing_samples / ring attention need the real package")
        return fn

    def module(name, package=False):
        # A spec, so that importlib.util.find_spec (Transformers' availability checks) does not
        # raise on a spec-less module; no __file__ and no __version__, so those checks still find
        # no flash_attn installed.
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
        if package:
            m.__path__ = []
        return m

    pkg = module("flash_attn", package=True)
    bert_padding = module("flash_attn.bert_padding")
    for name in ("index_first_axis", "pad_input", "unpad_input"):
        setattr(bert_padding, name, missing(f"bert_padding.{name}"))
    bert_padding.rearrange = einops.rearrange  # re-exported by flash_attn.bert_padding
    utils = module("flash_attn.utils", package=True)
    distributed = module("flash_attn.utils.distributed")
    distributed.all_gather = missing("utils.distributed.all_gather")
    pkg.bert_padding, pkg.utils, utils.distributed = bert_padding, utils, distributed
    sys.modules.update({"flash_attn": pkg, "flash_attn.bert_padding": bert_padding,
                        "flash_attn.utils": utils, "flash_attn.utils.distributed": distributed})
    say("flash_attn not installed: stand-in modules for openrlhf.models.ring_attn_utils' imports")


def shim_zero3_weight_mapping():
    """OpenRLHF 0.11.0 (pinned to transformers 5.15) patches transformers'
    ``_apply_weight_conversions_to_state_dict`` for ZeRO-3 loading (OpenRLHF issue #1232) and calls
    ``.update`` on what the original returns; in transformers 5.24 that function is a generator of
    state dicts (loaded one at a time), so OpenRLHF's patch raises AttributeError on every ZeRO-3
    Actor load. Here OpenRLHF's patch runs as written, between two adapters: below it the
    generator's dicts are merged into one dict (what 5.15 returned), above it that dict is handed
    to transformers as a one-element list (what 5.24's caller iterates). Same tensors, same keys."""
    import inspect

    import openrlhf.models.actor as actor
    import transformers.integrations.deepspeed as hf_deepspeed
    upstream_patch = actor._patch_zero3_weight_mapping

    def _patch_zero3_weight_mapping():
        current = getattr(hf_deepspeed, "_apply_weight_conversions_to_state_dict", None)
        if current is None or getattr(current, "_openrlhf_patched", False) or not inspect.isgeneratorfunction(current):
            return upstream_patch()

        def as_dict(model, state_dict, weight_mapping):
            merged = {}
            for part in current(model, state_dict, weight_mapping):
                merged.update(part)
            return merged

        hf_deepspeed._apply_weight_conversions_to_state_dict = as_dict
        upstream_patch()  # wraps as_dict
        openrlhf_fn = hf_deepspeed._apply_weight_conversions_to_state_dict

        def as_list(model, state_dict, weight_mapping):
            return [openrlhf_fn(model, state_dict, weight_mapping)]

        as_list._openrlhf_patched = True
        hf_deepspeed._apply_weight_conversions_to_state_dict = as_list
        say("transformers 5.24: _apply_weight_conversions_to_state_dict yields state dicts; OpenRLHF's ZeRO-3 "
            "patch of it (written for 5.15's dict) runs on their merged dict, handed back as a list")

    actor._patch_zero3_weight_mapping = _patch_zero3_weight_mapping


# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------

def variant_fp32():
    import openrlhf.utils.deepspeed.deepspeed as ds_strategy
    import openrlhf.utils.utils as utils
    import torch

    upstream_dtype = utils.convert_to_torch_dtype

    def convert_to_torch_dtype(param_dtype):
        upstream_dtype(param_dtype)  # same validation
        return torch.float32

    utils.convert_to_torch_dtype = once("--fp32: models load in float32")(convert_to_torch_dtype)

    def no_bf16(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            cfg = fn(*args, **kwargs)
            cfg["bf16"]["enabled"] = False
            return cfg
        return inner

    for name in ("get_train_ds_config", "get_eval_ds_config"):
        setattr(ds_strategy, name, once(f"--fp32: {name} with bf16 disabled")(no_bf16(getattr(ds_strategy, name))))


def variant_one_backward():
    from openrlhf.trainer.dpo_trainer import DPOTrainer
    upstream_init = DPOTrainer.__init__

    @once("--one-backward: DPO trainer's strategy.backward(loss, model, optimizer) -> loss.backward()")
    def plain_backward(loss, model, optimizer, **kwargs):
        loss.backward()

    @functools.wraps(upstream_init)
    def __init__(self, *args, **kwargs):
        upstream_init(self, *args, **kwargs)
        # An instance attribute on this trainer's strategy: the one place fit() calls it.
        self.strategy.backward = plain_backward

    DPOTrainer.__init__ = __init__


# ----------------------------------------------------------------------------------------------
# Recorders
# ----------------------------------------------------------------------------------------------

def _plain(v):
    import torch
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


def record_logs(module, record_dir):
    trainer_of = {"openrlhf.cli.train_sft": ("openrlhf.trainer.sft_trainer", "SFTTrainer"),
                  "openrlhf.cli.train_rm": ("openrlhf.trainer.rm_trainer", "RewardModelTrainer"),
                  "openrlhf.cli.train_dpo": ("openrlhf.trainer.dpo_trainer", "DPOTrainer")}
    mod_name, cls_name = trainer_of[module]
    import importlib
    cls = getattr(importlib.import_module(mod_name), cls_name)
    upstream = cls.save_logs_and_checkpoints
    path = os.path.join(record_dir, "logs.jsonl")

    @functools.wraps(upstream)
    def save_logs_and_checkpoints(self, args, global_step, step_bar, logs_dict=None, client_states=None):
        if rank() == 0:
            row = {"global_step": global_step, **{k: _plain(v) for k, v in (logs_dict or {}).items()}}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return upstream(self, args, global_step, step_bar, logs_dict, client_states)

    cls.save_logs_and_checkpoints = save_logs_and_checkpoints


def record_master_weights(record_dir):
    import openrlhf.utils.deepspeed.deepspeed as ds_strategy
    import torch
    from deepspeed.utils import safe_get_full_fp32_param
    from openrlhf.models import Actor
    upstream = ds_strategy.DeepspeedStrategy.save_model

    @functools.wraps(upstream)
    def save_model(self, model, tokenizer, output_dir, **kwargs):
        engine = model.model if isinstance(model, Actor) else model
        found = {}
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                full = safe_get_full_fp32_param(p)  # a collective at ZeRO-3: every rank calls it
                if full is not None:
                    found[name] = full.detach().cpu().clone()
        if rank() == 0:
            torch.save(found, os.path.join(record_dir, "master_fp32.pt"))
        return upstream(self, model, tokenizer, output_dir, **kwargs)

    ds_strategy.DeepspeedStrategy.save_model = save_model


def record_ds_configs(record_dir):
    """Every config OpenRLHF passes to deepspeed.initialize (rank 0) -> DIR/ds_configs.json: what a
    failure on one side is read against (OpenRLHF's get_train_ds_config sets e.g. zero_hpz_partition_size)."""
    import deepspeed
    path = os.path.join(record_dir, "ds_configs.json")
    upstream = deepspeed.initialize  # the swap's wrapper on "ours": it is called through this one

    depth = []  # deepspeed_multi.initialize calls deepspeed.initialize itself: record the outer call only

    @functools.wraps(upstream)
    def initialize(*args, **kwargs):
        if rank() == 0 and not depth:
            found = json.load(open(path)) if os.path.exists(path) else []
            found.append(kwargs.get("config"))
            with open(path, "w") as f:
                json.dump(found, f, indent=1, default=str)
        depth.append(True)
        try:
            return upstream(*args, **kwargs)
        finally:
            depth.pop()

    deepspeed.initialize = initialize


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", required=True, help="e.g. openrlhf.cli.train_sft")
    ap.add_argument("--record", required=True, help="folder for logs.jsonl and master_fp32.pt")
    ap.add_argument("--one-backward", action="store_true")
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the CLI's own arguments")
    args = ap.parse_args()
    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    os.makedirs(args.record, exist_ok=True)

    shim_cuda()
    shim_flash_attn()
    shim_zero3_weight_mapping()
    if args.fp32:
        variant_fp32()
    if args.one_backward:
        if args.module != "openrlhf.cli.train_dpo":
            raise SystemExit("--one-backward is for openrlhf.cli.train_dpo")
        variant_one_backward()
    record_logs(args.module, args.record)
    record_master_weights(args.record)
    record_ds_configs(args.record)

    sys.argv = [args.module] + cli
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
