"""One checkpoint for a set of engines: ``deepspeed_multi.save_checkpoint`` / ``load_checkpoint``.

Layout of ``<save_dir>/<tag>/``::

    manifest.json          what ties the engines together (below); written last
    <name>/...             each engine's own DeepSpeed checkpoint (engine.save_checkpoint(<save_dir>/<tag>, tag=<name>)),
                           so engine.load_checkpoint(<save_dir>/<tag>, tag=<name>) and zero_to_fp32 read it;
                           none for an inference-only engine (built without an optimizer): DeepSpeed cannot
                           save one at ZeRO-3, and its weights never change. The manifest keeps a sha256 of
                           its weights instead, and load refuses an engine built with other weights.
    zero_to_fp32.py        DeepSpeed's recovery script (``python zero_to_fp32.py . out --tag <name>``)
    rng/rank<r>.pt         every rank's torch / CUDA / numpy / python RNG states
    client_state.pt        the caller's client_state (data position, anything picklable)

and ``<save_dir>/latest`` names the newest tag.

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
import hashlib
import json
import logging
import os
import random
import secrets
import shutil

import deepspeed.comm as dist
import torch

from . import resize
from .checkpoint_disks import LATEST, _choose_on_every_disk, _copy_common_files, _Disks, _holders_text, _needed_by
from .state import TrainingState

logger = logging.getLogger(__name__)

FORMAT = "deepspeed_multi.checkpoint/1"
MANIFEST = "manifest.json"
_STAGING = ".{tag}.staging"

# The phases of a save, logged at DEBUG as "save_checkpoint phase: <name>" when each is reached
# (tests/multi_gpu/test_checkpoint.py kills a rank at each of them to test recovery).
PHASES = ("before", "between_engines", "after_engines", "before_rename", "before_latest", "after")


def _phase(name):
    logger.debug("save_checkpoint phase: %s", name)


# ---------------------------------------------------------------------------------- save
def save_checkpoint(save_dir, engines, client_state=None, tag=None):
    """Save every engine of ``engines`` (a dict name -> MultiEngine) as one checkpoint; return its path.

    Call on every rank, like ``engine.save_checkpoint``. ``tag`` defaults to
    ``global_step<N>`` (N: the largest global_steps among the engines); an existing tag is refused.
    """
    engines, parted = _expand_parted(engines, "save_checkpoint")
    if parted:
        client_state = {_PARTED: {name: e._client_states() for name, e in parted.items()}, "client_state": client_state}
    _check_engine_set(engines, "save_checkpoint")
    _raise_if_any(_pending_gradients(engines))  # decided together: a rank that refused alone would hang the others
    rank, world = dist.get_rank(), dist.get_world_size()
    if tag is None:
        tag = f"global_step{max(e.global_steps for e in engines.values())}"
    tag = _same_on_every_rank(str(tag), "tag")
    _check_name(tag, "tag")
    final, staging = os.path.join(save_dir, tag), os.path.join(save_dir, _STAGING.format(tag=tag))
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
    _raise_if_any(error)

    for i, (name, engine) in enumerate(engines.items()):
        if engine.has_optimizer:
            engine.save_checkpoint(staging, tag=name, client_state={}, save_latest=False)
        if i == 0:
            _phase("between_engines")
    torch.save(_rng_state(), os.path.join(staging, "rng", f"rank{rank}.pt"))
    if rank == 0:
        torch.save(client_state, os.path.join(staging, "client_state.pt"))
    _phase("after_engines")
    dist.barrier()
    if not disks.shared:
        _copy_common_files(staging, disks)

    sums = _checksums(staging, disks=disks)
    records = {name: _engine_record(e) for name, e in engines.items()}  # collective for inference-only engines
    # One serial, time and id for the copies on every disk (load checks that they match).
    serials = [None] * world
    dist.all_gather_object(serials, (max((s for s, _ in _complete_tags(save_dir)[0]), default=0)
                                     if disks.leads(rank) else 0,
                                     datetime.datetime.now(datetime.timezone.utc).isoformat(), secrets.token_hex(8)))
    if disks.leads(rank):
        manifest = {"format": FORMAT, "tag": tag, "serial": 1 + max(s for s, _, _ in serials),
                    "saved_at": serials[0][1], "save_id": serials[0][2], "world_size": world,
                    "engines": records, "files": sums[disks.disk_of(rank)], "storage": disks.describe(sums)}
        _write_atomically(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1))
        _phase("before_rename")
        os.rename(staging, final)
        _fsync_dir(save_dir)
    # Every disk has published the tag before any `latest` names it: a tag some disk's `latest`
    # names is complete on every disk, which is how load tells a lost copy from an interrupted save.
    dist.barrier()
    if disks.leads(rank):
        _phase("before_latest")
        _write_atomically(os.path.join(save_dir, LATEST), tag)
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
            "loss_scale": float(e._get_optimizer_loss_scale()) if e.fp16_enabled() and e.has_optimizer else None,
            "weights_sha256": None if e.has_optimizer else _weights_digest(e)}


def _weights_digest(engine):
    """sha256 of every parameter and buffer of the engine's module, ZeRO-3 partitions gathered."""
    import deepspeed
    h = hashlib.sha256()
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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


# ---------------------------------------------------------------------------------- disks
def _disk_view(load_dir):
    """What one disk holds: its complete tags' manifests, what its `latest` names, its incomplete tags."""
    complete, incomplete = _complete_tags(load_dir)
    latest = os.path.join(load_dir, LATEST)
    try:
        pointed = open(latest).read().strip() if os.path.isfile(latest) else None
    except OSError:
        pointed = None
    return {"complete": {m["tag"]: m for _, m in complete}, "latest": pointed, "incomplete": incomplete}


# ---------------------------------------------------------------------------------- load
def load_checkpoint(load_dir, engines, tag=None):
    """Load a set checkpoint into ``engines`` (the same names as when saved); return its ``client_state``.

    Call on every rank, with freshly built engines (as DeepSpeed requires for ZeRO-3). ``tag``
    defaults to the newest complete checkpoint in ``load_dir``; incomplete ones are skipped with a
    warning. Restores each engine's DeepSpeed state, its accumulation-window position and every
    rank's RNG states; checks every file's sha256 first.
    """
    engines, parted = _expand_parted(engines, "load_checkpoint")
    _check_engine_set(engines, "load_checkpoint")
    rank, world = dist.get_rank(), dist.get_world_size()
    disks = _Disks.probe(load_dir, create=False)
    # Every rank decides from what every disk holds, before anything is loaded: a disk without the
    # chosen tag fails every rank, and no engine is half-loaded.
    views = [None] * world
    dist.all_gather_object(views, _disk_view(load_dir) if disks.leads(rank) else None)
    views = [views[disks.leader(d)] for d in range(len(disks.disks))]
    try:
        manifest = _choose_on_every_disk(load_dir, tag, views, disks)[disks.disk_of(rank)]
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"deepspeed_multi.load_checkpoint: {e}") from None
    path = os.path.join(load_dir, manifest["tag"])
    if sorted(manifest["engines"]) != sorted(engines):
        raise ValueError(f"deepspeed_multi.load_checkpoint: {path} holds engines {sorted(manifest['engines'])}, "
                         f"given {sorted(engines)}; pass the same names as to save_checkpoint.")
    bad = _checksums(path, expected=manifest["files"], disks=disks)
    _raise_if_any(f"deepspeed_multi.load_checkpoint: {path} is damaged{disks.on_disk_of(rank)}: {bad}" if bad else None)
    resized = manifest["world_size"] != world
    if not resized:
        missing = [f for f in _needed_by(rank, world) if f not in manifest["files"]]
        _raise_if_any(f"deepspeed_multi.load_checkpoint: rank {rank} needs {missing} of {path}, which the copy"
                      f"{disks.on_disk_of(rank)} does not hold (ranks saved their files on their own node's disk: "
                      f"{_holders_text(manifest)}); start every rank on the node that saved its files, or copy "
                      "them there." if missing else None)
    if resized:  # see [Note: resuming at another world size]
        _warn_resized(path, manifest, engines, world)
    converted = _convert_for(load_dir, path, manifest, engines, disks) if resized else {}
    for name, engine in engines.items():
        record = manifest["engines"][name]
        if record["zero_stage"] != engine.zero_optimization_stage() or record["class"] != engine._engine_name():
            raise ValueError(f"deepspeed_multi.load_checkpoint: engine {name!r} was saved as {record['class']} at ZeRO "
                             f"stage {record['zero_stage']}, given {engine._engine_name()} at stage "
                             f"{engine.zero_optimization_stage()}; build it as it was saved.")
        if not engine.has_optimizer:
            if record["weights_sha256"] != _weights_digest(engine):
                raise ValueError(f"deepspeed_multi.load_checkpoint: inference-only engine {name!r} "
                                 f"({engine._engine_name()}) was built with other weights than at the save; its "
                                 "weights are not in the checkpoint (they never change): build it from the same "
                                 "weights as the saved run.")
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
    every rank waits for it."""
    names = [n for n, e in engines.items() if e.has_optimizer and resize.partitioned(os.path.join(path, n))]
    if not names:
        return {}
    target = resize.universal_dir(load_dir, manifest)
    error = None
    if disks.leads(dist.get_rank()):
        missing = resize.missing_slices(path, names, manifest["world_size"])
        if missing:
            error = (f"resuming {path} (saved by {manifest['world_size']} ranks) on {dist.get_world_size()} converts "
                     f"every engine's optimizer slices of every saved rank, and the copy{disks.on_disk_of(dist.get_rank())} "
                     f"lacks {missing[:6]}{' ...' if len(missing) > 6 else ''} ({len(missing)} files): they were saved on "
                     f"other nodes' disks ({_holders_text(manifest)}). Copy the whole {path} of every node that saved "
                     "it into this node's copy (the files do not overlap), then resume.")
        else:
            error = resize.convert(path, names, target)
    _raise_if_any(f"deepspeed_multi.load_checkpoint: {error}" if error else None)
    return {name: target for name in names}


def _choose(load_dir, tag):
    complete, incomplete = _complete_tags(load_dir)
    for path, why in incomplete:
        logger.warning("deepspeed_multi.load_checkpoint: ignoring incomplete checkpoint %s (%s); "
                       "deepspeed_multi.checkpoint.remove_incomplete(%r) deletes it.", path, why, load_dir)
    by_tag = {m["tag"]: m for _, m in complete}
    if tag is not None:
        if str(tag) not in by_tag:
            raise FileNotFoundError(f"no complete checkpoint with tag {tag!r} in {load_dir} (complete tags: "
                                    f"{sorted(by_tag)})")
        return by_tag[str(tag)]
    if not complete:
        raise FileNotFoundError(f"no complete deepspeed_multi checkpoint in {load_dir}")
    newest = max(complete, key=lambda c: c[0])[1]
    latest = os.path.join(load_dir, LATEST)
    pointed = open(latest).read().strip() if os.path.isfile(latest) else None
    if pointed != newest["tag"]:
        logger.warning("deepspeed_multi.load_checkpoint: %s names %r, but the newest complete checkpoint is %r "
                       "(a save ended between its rename and the update of latest); loading %r.", latest, pointed,
                       newest["tag"], newest["tag"])
    return newest


def _read_manifest(path):
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"no valid {MANIFEST}: {type(e).__name__}"
    if manifest.get("format") != FORMAT:
        return None, f"{MANIFEST} has format {manifest.get('format')!r}, expected {FORMAT!r}"
    missing = [f for f in manifest["files"] if not os.path.isfile(os.path.join(path, f))]
    if missing:
        return None, f"files listed in {MANIFEST} are missing: {missing[:3]}"
    return manifest, None


def _complete_tags(directory):
    """``([(serial, manifest)], [(path, why incomplete)])`` for the checkpoints under ``directory``.

    A tag directory whose manifest is unreadable or lists missing files is incomplete; other
    directories (an engine's own DeepSpeed checkpoint, anything else) are left out silently.
    """
    complete, incomplete = [], []
    if not os.path.isdir(directory):
        return complete, incomplete
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if not os.path.isdir(path):
            continue
        if entry.startswith(".") and entry.endswith(".staging"):
            incomplete.append((path, "a save that never finished"))
            continue
        if not (os.path.exists(os.path.join(path, MANIFEST)) or os.path.isdir(os.path.join(path, "rng"))):
            continue  # not a set checkpoint (e.g. an engine's own DeepSpeed checkpoint): not ours to judge
        manifest, why = _read_manifest(path)
        if manifest is None:
            incomplete.append((path, why))
        else:
            complete.append((manifest["serial"], manifest))
    return complete, incomplete


def remove_incomplete(directory):
    """Delete the staging directories and tags without a valid manifest under ``directory``;
    return their paths. Call from one process, while no save is running."""
    removed = []
    for path, _ in _complete_tags(directory)[1]:
        shutil.rmtree(path)
        removed.append(path)
    return removed


# ---------------------------------------------------------------------------------- helpers
_PARTED = "deepspeed_multi.parted"  # client_state key: the client optimizer and scheduler of each model in parts


def _expand_parted(engines, what):
    """A model in parts (PartedEngine) in the set is saved as its parts, ``<name>.<part>``, and its
    client optimizer and scheduler states in the client state; returns (engines, {name: PartedEngine})."""
    from .parts import PartedEngine
    if not isinstance(engines, dict) or not any(isinstance(e, PartedEngine) for e in engines.values()):
        return engines, {}
    flat, parted = {}, {}
    for name, e in engines.items():
        if isinstance(e, PartedEngine):
            _check_name(name, f"engine name {name!r}")
            parted[name] = e
            flat.update({f"{name}.{part}": pe for part, pe in e.parts.items()})
        else:
            flat[name] = e
    if len(flat) != sum(len(e.parts) if name in parted else 1 for name, e in engines.items()):
        raise ValueError(f"deepspeed_multi.{what}: the names of the engines and of the models' parts "
                         f"(<name>.<part>) collide: {sorted(engines)}; rename an engine.")
    return flat, parted


def _check_engine_set(engines, what):
    from .engine import MultiEngine
    if not isinstance(engines, dict) or not engines:
        raise TypeError(f"deepspeed_multi.{what}: engines must be a non-empty dict name -> engine, got "
                        f"{type(engines).__name__}")
    for name, e in engines.items():
        _check_name(name, f"engine name {name!r}")
        if not isinstance(e, MultiEngine):
            raise TypeError(f"deepspeed_multi.{what}: engines[{name!r}] is a {type(e).__name__}, not a MultiEngine; "
                            "build it with deepspeed_multi.initialize.")


def _check_name(name, what):
    if not isinstance(name, str) or not name or name.startswith(".") or os.sep in name or name in (MANIFEST, "rng"):
        raise ValueError(f"deepspeed_multi checkpoint: {what} must be a non-empty directory name without "
                         f"{os.sep!r}, not starting with '.', and not {MANIFEST!r} or 'rng'; got {name!r}.")


def _same_on_every_rank(value, what):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) != 1:
        raise ValueError(f"deepspeed_multi.save_checkpoint: the {what} differs between ranks: {values}; pass the "
                         "same value on every rank.")
    return value


def _raise_if_any(error):
    """Every rank raises when any rank found an error (so no rank is left waiting in a collective)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        raise RuntimeError(errors[0])


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checksums(root, expected=None, disks=None):
    """sha256 of every file under ``root``, the ranks of each disk hashing their share of it.

    Without ``expected``: returns ``{disk: {relative path: {"sha256", "bytes"}}}`` on every rank
    (one disk, 0, unless the ranks' storage is node-local). With it (this rank's disk's manifest
    files): returns the list of those files that are missing or differ on this rank's disk.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    disks = disks or _Disks.single(world)
    disk = disks.disk_of(rank)
    peers = disks.ranks_of(disk)
    if expected is None:
        files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    else:
        files = sorted(expected)
    mine = {}
    for f in files[peers.index(rank)::len(peers)]:
        full = os.path.join(root, f)
        if expected is None:
            mine[f] = {"sha256": _sha256(full), "bytes": os.path.getsize(full)}
        elif not os.path.isfile(full) or _sha256(full) != expected[f]["sha256"]:
            mine[f] = "missing" if not os.path.isfile(full) else "checksum differs"
    gathered = [None] * world
    dist.all_gather_object(gathered, (disk, mine))
    merged = {}
    for d, part in gathered:
        merged.setdefault(d, {}).update(part)
    if expected is None:
        return {d: dict(sorted(merged.get(d, {}).items())) for d in range(len(disks.disks))}
    return sorted(f"{k} ({v})" for k, v in merged.get(disk, {}).items())


def _write_atomically(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
