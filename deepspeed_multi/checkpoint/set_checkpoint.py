"""One checkpoint for a set of engines: ``deepspeed_multi.save_checkpoint`` / ``load_checkpoint``.

Layout of ``<save_dir>/<tag>/``::

    manifest.json          what ties the engines together (below); written last
    <name>/...             each engine's own DeepSpeed checkpoint (engine.save_checkpoint(<save_dir>/<tag>, tag=<name>)),
                           so engine.load_checkpoint(<save_dir>/<tag>, tag=<name>) and zero_to_fp32 read it;
                           none for an engine built without an optimizer (DeepSpeed cannot save one at
                           ZeRO-3): its parameters are in <save_dir>/.frozen/ (below)
    zero_to_fp32.py        DeepSpeed's recovery script (``python zero_to_fp32.py . out --tag <name>``)
    rng/rank<r>.pt         every rank's torch / CUDA / numpy / python RNG states
    buffers/rank<r>.pt     every rank's buffers of every engine (BatchNorm statistics, ...)
    client_state.pt        the caller's client_state (data position, anything picklable)

and ``<save_dir>/latest`` names the newest tag. ``<save_dir>/.frozen/<sha256>.pt`` holds the parameters
of the engines without an optimizer, content-addressed and shared by the tags that reference them
(see [Note: frozen engines change] and [Note: buffers rank by rank] in module_state.py).

[Note: a save is atomic]
Everything is written under ``<save_dir>/.<tag>.staging``; when every rank has written its
files, their sha256 sums go into manifest.json (written to a temporary name, fsynced, renamed),
and rank 0 publishes the tag with one ``os.rename`` of the staging directory, then replaces
``latest`` the same way (temporary file + ``os.replace``). A job killed at any instant leaves
either the previous checkpoints only (plus a staging directory, which load ignores with a
warning and :func:`remove_incomplete` deletes) or the new, complete tag. Load takes the
complete tag (valid manifest, every checksum right) with the highest save serial, whatever
``latest`` says: ``latest`` may lag one rename behind.

[Note: node-local storage]
On several nodes, ``save_dir`` may be one filesystem every node sees (NFS, Lustre) or each node's
own disk at the same path (local SSDs). Every save and load first finds out which: the first rank
of each node writes a probe file named by a token rank 0 drew, and each reports which nodes'
probes it sees; nodes that see each other's probes share a disk (one node alone: no probe).
Each disk then gets its own complete copy of what its ranks need, committed as on one disk: its
first rank creates the staging directory, writes the manifest and renames it. The files DeepSpeed
writes on global rank 0 only (the model states below ZeRO-3, zero_to_fp32.py) and the client
state are sent to every other disk; the per-rank files (optimizer slices, ZeRO-3 parameter
partitions, RNG states) stay on the disk of the node whose rank wrote them. Each disk's manifest
lists its own files and, under "storage", which nodes and ranks hold which disk.
A save ends in two steps: every disk renames its staging directory, all ranks meet, then every
disk's ``latest`` names the tag. So a tag that any ``latest`` names is complete on every disk. At
load, every rank learns what every disk holds before anything is loaded: a disk that lacks a tag
another disk's ``latest`` names (its copy was lost, or it holds only an older tag) fails every
rank with the node and the tag; a tag complete on some disks and named by no ``latest`` is a save
killed between the renames, and the newest tag complete on every disk is loaded instead.

[Note: saving inside an accumulation window]
A save is refused while a trainable engine holds gradients (after a backward, before the
step() that ends its window, or inside a backward): DeepSpeed's checkpoint has no place for
accumulated gradients, so the resumed run would silently lose them. The window position
itself is saved (a window emptied by zero_grad() resumes exactly).
"""
import datetime
import json
import logging
import os
import random
import secrets
import shutil

import deepspeed.comm as dist
import torch

from ..state import TrainingState
from . import module_state, resize
from .disks import LATEST, _choose_on_every_disk, _copy_common_files, _Disks, _holders_text, _needed_by
from .files import checksums, raise_if_any, same_on_every_rank
from .tags import FORMAT, MANIFEST, STAGING, check_name, complete_tags, disk_view, fsync_dir, write_atomically

logger = logging.getLogger("deepspeed_multi.checkpoint")

# The phases of a save, logged at DEBUG as "save_checkpoint phase: <name>" when each is reached
# (tests/multi_gpu/test_checkpoint.py kills a rank at each of them to test recovery).
PHASES = ("before", "between_engines", "after_engines", "before_rename", "before_latest", "after")


def _phase(name):
    logger.debug("save_checkpoint phase: %s", name)


# ---------------------------------------------------------------------------------- save
def save_checkpoint(save_dir, engines, client_state=None, tag=None):
    """Save a set of engines as one checkpoint, atomically: the tag is complete or absent.

    Call on every rank, like ``engine.save_checkpoint``. Each engine's DeepSpeed state, the parameters
    of engines without an optimizer (stored once while unchanged), every engine's buffers, the position
    in each accumulation window and every rank's RNG states are written under a staging name, checked,
    and renamed into place (docs/failure_and_recovery.md).

    Args:
        save_dir (str): the directory that holds the tags (created if missing).
        engines (dict): name -> engine (a MultiEngine, or the parts of one model in parts).
        client_state (dict, optional): saved beside the engines, returned by :func:`load_checkpoint`.
        tag (str, optional): the checkpoint's name; default ``global_step<N>``, N the largest
            ``global_steps`` among the engines. The same on every rank.

    Returns:
        str: the path of the saved checkpoint, ``<save_dir>/<tag>``.

    Raises:
        RuntimeError: on every rank together, where any rank found an error: the tag exists already (it is
            never overwritten), an engine holds gradients of an unfinished accumulation window, a write failed.
        ValueError: ``engines`` is not a dict of engines, or ``tag`` is not a plain directory name.
    """
    engines, parted = _expand_parted(engines, "save_checkpoint")
    if parted:
        client_state = {_PARTED: {name: e._client_states() for name, e in parted.items()}, "client_state": client_state}
    _check_engine_set(engines, "save_checkpoint")
    raise_if_any(_pending_gradients(engines))  # decided together: a rank that refused alone would hang the others
    rank, world = dist.get_rank(), dist.get_world_size()
    if tag is None:
        tag = f"global_step{max(e.global_steps for e in engines.values())}"
    tag = same_on_every_rank(str(tag), "tag")
    check_name(tag, "tag")
    final, staging = os.path.join(save_dir, tag), os.path.join(save_dir, STAGING.format(tag=tag))
    disks = _Disks.probe(save_dir, create=True)  # see [Note: node-local storage]
    _phase("before")
    error = None
    if disks.leads(rank):
        if os.path.exists(final):
            error = (f"deepspeed_multi.save_checkpoint: {final} already exists{disks.on_disk_of(rank)}; pass another "
                     "tag= (or delete it). A tag is never overwritten, so a crash during a save cannot damage it.")
        else:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
            os.makedirs(os.path.join(staging, "rng"))
            os.makedirs(os.path.join(staging, "buffers"))
    raise_if_any(error)

    frozen, objects = {}, set()
    for i, (name, engine) in enumerate(engines.items()):
        if engine.has_optimizer:
            engine.save_checkpoint(staging, tag=name, client_state={}, save_latest=False)
        else:  # see [Note: frozen engines change] in module_state.py
            frozen[name], held = module_state.save_frozen(save_dir, name, engine, disks)
            objects.update(held)
        if i == 0:
            _phase("between_engines")
    torch.save(_rng_state(), os.path.join(staging, "rng", f"rank{rank}.pt"))
    torch.save(module_state.buffers_of(engines), os.path.join(staging, "buffers", f"rank{rank}.pt"))
    if rank == 0:
        torch.save(client_state, os.path.join(staging, "client_state.pt"))
    _phase("after_engines")
    dist.barrier()
    if not disks.shared:
        _copy_common_files(staging, disks)

    sums = checksums(staging, disks=disks)
    records = {name: dict(_engine_record(e), frozen=frozen.get(name)) for name, e in engines.items()}
    # One serial, time and id for the copies on every disk (load checks that they match).
    serials = [None] * world
    dist.all_gather_object(serials, (max((s for s, _ in complete_tags(save_dir)[0]), default=0)
                                     if disks.leads(rank) else 0,
                                     datetime.datetime.now(datetime.timezone.utc).isoformat(), secrets.token_hex(8)))
    if disks.leads(rank):
        manifest = {"format": FORMAT, "tag": tag, "serial": 1 + max(s for s, _, _ in serials),
                    "saved_at": serials[0][1], "save_id": serials[0][2], "world_size": world,
                    "engines": records, "files": sums[disks.disk_of(rank)], "objects": sorted(objects),
                    "storage": disks.describe(sums)}
        write_atomically(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1))
        _phase("before_rename")
        os.rename(staging, final)
        fsync_dir(save_dir)
    # Every disk has published the tag before any `latest` names it: a tag some disk's `latest`
    # names is complete on every disk, which is how load tells a lost copy from an interrupted save.
    dist.barrier()
    if disks.leads(rank):
        _phase("before_latest")
        write_atomically(os.path.join(save_dir, LATEST), tag)
    _phase("after")
    dist.barrier()
    return final


def _pending_gradients(engines):
    """Why this rank cannot save now (see [Note: saving inside an accumulation window]), or None."""
    for name, e in engines.items():
        if e._state is TrainingState.IN_BACKWARD:
            return (f"deepspeed_multi.save_checkpoint: engine {name!r} ({e._engine_name()}) is inside a backward "
                    "pass; save after loss.backward() returns and step() ends the window.")
        if e._state is TrainingState.GRADS_READY and e.trains:
            return (
                f"deepspeed_multi.save_checkpoint: engine {name!r} ({e._engine_name()}) holds the gradients of "
                f"{e._window_backwards} backward pass(es) of an unfinished accumulation window (micro-step "
                f"{e._window_micro_steps} of {e.gradient_accumulation_steps()}); a checkpoint cannot hold them, so "
                "the resumed run would lose them. Save after the step() that ends the window "
                "(engine.is_update_boundary() was True before it), or call engine.zero_grad() first to drop them.")
    return None


def _engine_record(e):
    return {"class": e._engine_name(), "zero_stage": e.zero_optimization_stage(),
            "dtype": "bf16" if e.bfloat16_enabled() else "fp16" if e.fp16_enabled() else "fp32",
            "trains": e.trains, "global_steps": e.global_steps, "global_samples": e.global_samples,
            "skipped_steps": e.skipped_steps, "micro_steps": e.micro_steps,
            "window_micro_steps": e._window_micro_steps,
            "gradient_accumulation_steps": e.gradient_accumulation_steps(), "train_batch_size": e.train_batch_size(),
            "loss_scale": float(e._get_optimizer_loss_scale()) if e.fp16_enabled() and e.has_optimizer else None}


def _rng_state():
    import numpy as np
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state):
    import numpy as np
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------- load
def load_checkpoint(load_dir, engines, tag=None):
    """Load a set checkpoint saved by :func:`save_checkpoint` into freshly built engines.

    Call on every rank, with engines built as when saved (any weights; DeepSpeed requires fresh ZeRO-3
    engines). Every file's sha256 is checked first, then each engine's DeepSpeed state, the parameters
    of the engines without an optimizer, every engine's buffers, the accumulation-window position and
    every rank's RNG states are restored. On another number of ranks the engines are converted through
    DeepSpeed's universal checkpoint.

    Args:
        load_dir (str): the directory that holds the tags.
        engines (dict): name -> engine, the same names as when saved.
        tag (str, optional): the checkpoint to load; default the newest complete one (incomplete ones are
            skipped with a warning).

    Returns:
        The ``client_state`` given to :func:`save_checkpoint` (None if none was).

    Raises:
        FileNotFoundError: no complete checkpoint (or not ``tag``) in ``load_dir``, on some rank's disk.
        ValueError: the checkpoint holds other engine names than ``engines``.
        RuntimeError: on every rank together: a damaged file (checksum), a file a rank needs is missing, or
            an engine's state does not fit it.
    """
    engines, parted = _expand_parted(engines, "load_checkpoint")
    _check_engine_set(engines, "load_checkpoint")
    rank, world = dist.get_rank(), dist.get_world_size()
    disks = _Disks.probe(load_dir, create=False)
    # Every rank decides from what every disk holds, before anything is loaded: a disk without the
    # chosen tag fails every rank, and no engine is half-loaded.
    views = [None] * world
    dist.all_gather_object(views, disk_view(load_dir) if disks.leads(rank) else None)
    views = [views[disks.leader(d)] for d in range(len(disks.disks))]
    try:
        manifest = _choose_on_every_disk(load_dir, tag, views, disks)[disks.disk_of(rank)]
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"deepspeed_multi.load_checkpoint: {e}") from None
    path = os.path.join(load_dir, manifest["tag"])
    if sorted(manifest["engines"]) != sorted(engines):
        raise ValueError(f"deepspeed_multi.load_checkpoint: {path} holds engines {sorted(manifest['engines'])}, "
                         f"given {sorted(engines)}; pass the same names as to save_checkpoint.")
    bad = checksums(path, expected=manifest["files"], disks=disks)
    raise_if_any(f"deepspeed_multi.load_checkpoint: {path} is damaged{disks.on_disk_of(rank)}: {bad}" if bad else None)
    resized = manifest["world_size"] != world
    if not resized:
        missing = [f for f in _needed_by(rank, world) if f not in manifest["files"]]
        raise_if_any(f"deepspeed_multi.load_checkpoint: rank {rank} needs {missing} of {path}, which the copy"
                      f"{disks.on_disk_of(rank)} does not hold (ranks saved their files on their own node's disk: "
                      f"{_holders_text(manifest)}); start every rank on the node that saved its files, or copy "
                      "them there." if missing else None)
    if resized:  # see [Note: resuming at another world size]
        _warn_resized(path, manifest, engines, world)
    for name, engine in engines.items():
        record = manifest["engines"][name]
        if record["zero_stage"] != engine.zero_optimization_stage() or record["class"] != engine._engine_name() or (
                record["frozen"] is None) != engine.has_optimizer:
            raise ValueError(f"deepspeed_multi.load_checkpoint: engine {name!r} was saved as {record['class']} at ZeRO "
                             f"stage {record['zero_stage']} {'with' if record['frozen'] is None else 'without'} an "
                             f"optimizer, given {engine._engine_name()} at stage {engine.zero_optimization_stage()} "
                             f"{'with' if engine.has_optimizer else 'without'} one; build it as it was saved.")
    converted = _convert_for(load_dir, path, manifest, engines, disks) if resized else {}
    errors = [module_state.load_frozen(load_dir, name, e, manifest["engines"][name]["frozen"], resized)
              for name, e in engines.items() if not e.has_optimizer]
    raise_if_any(next((f"deepspeed_multi.load_checkpoint: {path}: {e}" for e in errors if e), None))
    for name, engine in engines.items():
        record = manifest["engines"][name]
        if not engine.has_optimizer:
            continue
        if name in converted:
            loaded, _ = resize.load_universal(engine, converted[name], name)
        else:
            loaded, _ = engine.load_checkpoint(path, tag=name)
        if loaded is None:
            raise FileNotFoundError(f"deepspeed_multi.load_checkpoint: DeepSpeed found no state for engine {name!r} "
                                    f"under {os.path.join(path, name)}.")
        engine.micro_steps = record["micro_steps"]
        engine._window_micro_steps = record["window_micro_steps"]
        if record["loss_scale"] is not None and float(engine._get_optimizer_loss_scale()) != record["loss_scale"]:
            raise RuntimeError(f"deepspeed_multi.load_checkpoint: engine {name!r}: loss scale "
                               f"{engine._get_optimizer_loss_scale()} after loading, {record['loss_scale']} saved.")
    # DeepSpeed gave every rank rank 0's buffers: see [Note: buffers rank by rank] in module_state.py.
    buffers = os.path.join(path, "buffers", f"rank{0 if resized else rank}.pt")
    error = (module_state.restore_buffers(engines, torch.load(buffers, weights_only=True), buffers)
             if os.path.isfile(buffers) else f"{buffers} is missing{disks.on_disk_of(rank)}")
    raise_if_any(f"deepspeed_multi.load_checkpoint: {error}" if error else None)
    if not resized:
        _set_rng_state(torch.load(os.path.join(path, "rng", f"rank{rank}.pt"), weights_only=False))
    client_state = torch.load(os.path.join(path, "client_state.pt"), weights_only=False)
    if parted:
        for name, e in parted.items():
            e._load_client_states(client_state[_PARTED][name])
        client_state = client_state["client_state"]
    dist.barrier()
    logger.info("deepspeed_multi: loaded checkpoint %s (serial %d)", path, manifest["serial"])
    return client_state


def _warn_resized(path, manifest, engines, world):
    """What a resume on another number of ranks does not carry over (rank 0 says it)."""
    if dist.get_rank() != 0:
        return
    logger.warning("deepspeed_multi.load_checkpoint: %s was saved by %d ranks, this job has %d: the engines' states "
                   "are re-partitioned, but the RNG states (one per saved rank) are not restored.", path,
                   manifest["world_size"], world)
    for name, e in engines.items():
        saved = manifest["engines"][name].get("train_batch_size")
        if saved is not None and saved != e.train_batch_size():
            logger.warning("deepspeed_multi.load_checkpoint: engine %r was saved with train_batch_size %d, resumes with "
                           "%d: the resumed run is not the uninterrupted one.", name, saved, e.train_batch_size())


def _convert_for(load_dir, path, manifest, engines, disks):
    """{engine name: root of its universal form} for the trained engines whose optimizer state was
    saved in slices for the saved world size; the first rank of each disk converts on that disk,
    every rank waits for it. First, every file of other ranks a resize reads (those slices, and the
    frozen engines' objects of every saved rank) must be on this rank's disk."""
    names = [n for n, e in engines.items() if e.has_optimizer and resize.partitioned(os.path.join(path, n))]
    target = resize.universal_dir(load_dir, manifest)
    error = None
    if disks.leads(dist.get_rank()):
        slices = resize.missing_slices(path, names, manifest["world_size"])
        frozen = [manifest["engines"][n]["frozen"] for n, e in engines.items() if not e.has_optimizer]
        objects = module_state.missing_objects(load_dir, [d for record in frozen for d in record["ranks"]])
        if slices or objects:
            lacks = " and ".join(f"{m[:6]}{' ...' if len(m) > 6 else ''}" for m in (slices, objects) if m)
            error = (f"resuming {path} (saved by {manifest['world_size']} ranks) on {dist.get_world_size()} reads "
                     f"every saved rank's optimizer slices and frozen-engine partitions, and the copy"
                     f"{disks.on_disk_of(dist.get_rank())} lacks {lacks} ({len(slices) + len(objects)} files): they "
                     f"were saved on other nodes' disks ({_holders_text(manifest)}). Copy "
                     f"the whole {load_dir} of every node that saved it into this node's copy (the files do not "
                     "overlap), then resume.")
        elif names:
            error = resize.convert(path, names, target)
    raise_if_any(f"deepspeed_multi.load_checkpoint: {error}" if error else None)
    return {name: target for name in names}


# ---------------------------------------------------------------------------------- helpers
_PARTED = "deepspeed_multi.parted"  # client_state key: the client optimizer and scheduler of each model in parts


def _expand_parted(engines, what):
    """A model in parts in the set is saved as its parts, ``<name>.<part>``, and its client optimizer
    and scheduler states in the client state; returns (engines, {name: model in parts}). A model in
    parts is whatever has ``checkpoint_parts()`` (parts.PartedEngine): the checkpoint asks it, so it
    does not import the parts package, which imports the checkpoint."""
    def parts_of(e):
        ask = getattr(e, "checkpoint_parts", None)
        return ask() if callable(ask) else None

    if not isinstance(engines, dict) or not any(parts_of(e) is not None for e in engines.values()):
        return engines, {}
    flat, parted, count = {}, {}, 0
    for name, e in engines.items():
        parts = parts_of(e)
        if parts is not None:
            check_name(name, f"engine name {name!r}")
            parted[name] = e
            flat.update({f"{name}.{part}": pe for part, pe in parts.items()})
            count += len(parts)
        else:
            flat[name] = e
            count += 1
    if len(flat) != count:
        raise ValueError(f"deepspeed_multi.{what}: the names of the engines and of the models' parts "
                         f"(<name>.<part>) collide: {sorted(engines)}; rename an engine.")
    return flat, parted


def _check_engine_set(engines, what):
    from ..engine import MultiEngine
    if not isinstance(engines, dict) or not engines:
        raise TypeError(f"deepspeed_multi.{what}: engines must be a non-empty dict name -> engine, got "
                        f"{type(engines).__name__}")
    for name, e in engines.items():
        check_name(name, f"engine name {name!r}")
        if not isinstance(e, MultiEngine):
            raise TypeError(f"deepspeed_multi.{what}: engines[{name!r}] is a {type(e).__name__}, not a MultiEngine; "
                            "build it with deepspeed_multi.initialize.")


