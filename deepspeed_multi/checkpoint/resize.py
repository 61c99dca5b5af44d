"""Resume a set checkpoint on another number of ranks (called by ``deepspeed_multi.load_checkpoint``).

[Note: resuming at another world size]
A set checkpoint holds each engine's own DeepSpeed checkpoint; what in it depends on the number
of ranks decides what a resume on M ranks of a save on N does:

- An engine whose optimizer state is partitioned (ZeRO-1/2/3, and bf16 at ZeRO-0, whose optimizer
  partitions its fp32 master copy as ZeRO-1 does) saved one ``*_optim_states.pt`` per rank: flat
  slices of fp32 master weights and optimizer states cut for N ranks. Rank 0 (on node-local disks,
  the first rank of each node) converts it with
  DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``: one file per parameter and
  state) into ``<load_dir>/.<tag>.universal.<digest>/<engine>``, once per checkpoint (the digest is
  the manifest's file sums, so a later tag of the same name is converted afresh), and every rank
  loads its new slices from it with the engine's ``load_universal_checkpoint`` switched on for
  that call alone: DeepSpeed's universal-checkpoint loading, not ours.
- An engine at ZeRO-0 in fp32 or fp16 keeps its whole optimizer state in its model-state file,
  which does not depend on the number of ranks: it loads as at the same size.
- An engine without an optimizer: its parameters (module_state.py) are loaded whole below ZeRO-3,
  and at ZeRO-3 reassembled from every saved rank's partition and cut for the new ranks; every
  rank gets rank 0's buffers.
- The counters (global steps and samples, the accumulation-window position, the loss scale) are
  the engines' and carry over. The RNG states are per rank and are NOT restored: rank r of M
  has no saved state when r >= N, and giving ranks each other's states would make their dropout
  masks equal. A run that draws from the global RNGs therefore resumes with fresh streams.
- The global batch is the caller's to keep: resuming with another ``train_batch_size`` than the
  saved one is allowed (jobs are resized to change it too) and logged, since the resumed run is
  then not the uninterrupted one.

The converted directory starts with '.', holds no manifest, and is never taken for a checkpoint;
a conversion killed half-way leaves ``.<tag>.universal.<digest>.converting``, redone next time.
The first rank of each disk that holds ``load_dir`` converts that disk's copy and the ranks of that
disk read it (one filesystem for all ranks: rank 0 alone; node-local disks: one conversion per
node, see [Note: node-local storage] in set_checkpoint.py). A node-local copy holds only its own ranks'
optimizer slices, so before a resume at another world size every copy needs the other nodes' slices
copied in: :func:`missing_slices` names them, and load fails on every rank until they are there.
"""
import argparse
import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import shutil

import torch

logger = logging.getLogger(__name__)

_OPTIM_FILES = "*_optim_states.pt"  # DeepSpeed's per-rank optimizer slices (zero_pp_rank_*, bf16_zero_pp_rank_*)


def universal_dir(load_dir, manifest):
    """Where the universal form of the checkpoint ``manifest`` describes is kept."""
    digest = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(load_dir, f".{manifest['tag']}.universal.{digest}")


def partitioned(engine_dir):
    """Whether an engine's DeepSpeed checkpoint holds optimizer slices cut for its world size."""
    return bool(glob.glob(os.path.join(engine_dir, _OPTIM_FILES)))


def missing_slices(path, names, world):
    """The optimizer-slice files of ``world`` saved ranks that the engines ``names`` lack under ``path``
    (on node-local storage each node's copy holds its own ranks' slices only)."""
    missing = []
    for name in names:
        have = {os.path.basename(f) for f in glob.glob(os.path.join(path, name, _OPTIM_FILES))}
        for r in range(world):
            if not any(f"zero_pp_rank_{r}_" in f for f in have):
                missing.append(os.path.join(name, f"*zero_pp_rank_{r}_*{_OPTIM_FILES[1:]}"))
    return missing


def convert(path, names, target):
    """Convert the engines ``names`` of the set checkpoint at ``path`` into universal form under
    ``target`` (one process; atomic: a staging directory renamed when every engine is done).
    Returns None, or why it failed."""
    if os.path.isdir(target):
        return None
    from deepspeed.checkpoint import ds_to_universal
    staging = target + ".converting"
    shutil.rmtree(staging, ignore_errors=True)
    for name in names:
        args = argparse.Namespace(input_folder=os.path.join(path, name), output_folder=os.path.join(staging, name),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)  # no tensor parallelism: the default info holds
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                ds_to_universal.main(args)
        except Exception as e:  # noqa: BLE001 - reported on every rank by the caller
            return (f"DeepSpeed's universal-checkpoint conversion (deepspeed.checkpoint.ds_to_universal) of engine "
                    f"{name!r} in {path} failed: {type(e).__name__}: {e}. Resume with the number of ranks it was "
                    f"saved with. Converter output:\n{printed.getvalue()[-2000:]}")
        logger.debug("ds_to_universal %s:\n%s", name, printed.getvalue())
    os.makedirs(staging, exist_ok=True)
    os.rename(staging, target)
    return None


def load_universal(engine, root, name):
    """``engine.load_checkpoint(root, tag=name)`` from the universal form, the engine's universal
    switch on for this call alone. Returns what load_checkpoint returns."""
    from .. import compat
    sixteen = engine.bfloat16_enabled() or engine.fp16_enabled()
    if sixteen and engine.zero_optimization_stage() < 3 and not compat.universal_16bit_below_zero3_ok():
        raise RuntimeError(
            f"deepspeed_multi: resuming engine {name!r} (ZeRO stage {engine.zero_optimization_stage()}, "
            f"{'bf16' if engine.bfloat16_enabled() else 'fp16'}) at another world size loads DeepSpeed's universal "
            f"checkpoint, which gives it wrong parameters with DeepSpeed {compat.installed_version()} (measured on "
            "0.19.4-0.19.6; right on 0.19.7 and 0.19.8). Install deepspeed==0.19.8, or resume on the number of ranks "
            "it was saved on.")
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        loaded = engine.load_checkpoint(root, tag=name)
    finally:
        config.load_universal_checkpoint = before
    _own_step_counters(getattr(engine, "optimizer", None))  # (None: an engine without one)
    return loaded


def _own_step_counters(optimizer) -> None:
    """[Note: one step counter per sub-group]
    DeepSpeed's ZeRO-3 universal load gives every sub-group's optimizer state the same ``step``
    tensor (read once from the checkpoint), and AdamW increments its ``step`` in place: with k
    sub-groups, one update advances it by k, so every later update's bias correction is the one of
    a later step. Upstream, a ZeRO-3 engine with several sub-groups resumed from a universal
    checkpoint is 2e-2 off its uninterrupted run after 4 AdamW steps (measured on 2 ranks,
    resumed on 2 or 4; one sub-group: exact). Each state gets a counter of its own."""
    base = getattr(optimizer, "optimizer", optimizer)
    seen = set()
    for state in getattr(base, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(state["step"]))
