"""The module state DeepSpeed's own checkpoint leaves out: the parameters of an engine built without
an optimizer, and every engine's buffers, rank by rank.

[Note: frozen engines change]
An engine without an optimizer trains nothing, yet its module can change: an EMA teacher updated in
place (at ZeRO-3 under ``GatheredParameters(..., modifier_rank=0)``), a reference model synced from
the policy, a model rebuilt from other weights by a restarted job. DDP's checkpoint holds every
module's state_dict, so the set checkpoint holds these engines' parameters too. DeepSpeed cannot save
an engine without an optimizer at ZeRO-3, so they are saved here, as each rank holds them: at ZeRO-3
its partition of every parameter (``param.ds_tensor``), below ZeRO-3 the full parameters.

They are stored content-addressed: ``<save_dir>/.frozen/<sha256 of the tensors>.pt``, one object per
distinct rank state (below ZeRO-3 the ranks hold the same tensors: one object), each written once per
directory (per disk on node-local storage) by the first rank of that disk that holds it, and
referenced by digest from each tag's manifest. An unchanged frozen model costs a hash per save and no
bytes; an EMA teacher costs its objects at every save. An object is written under a temporary name
and renamed, so it is whole or absent; load recomputes its digest, so a damaged one is refused by
name. ``remove_checkpoint`` and ``remove_incomplete`` delete the objects no complete tag references.

[Note: buffers rank by rank]
DeepSpeed neither reduces nor broadcasts buffers after initialize: each rank's BatchNorm running
statistics follow its own data. Its checkpoint saves rank 0's (in the model-state file) and its load
gives them to every rank, so the other ranks would resume with statistics they never had. Every rank
saves the persistent buffers of every engine (``buffers/rank<r>.pt``; 0-dim and integer ones
included) and load restores them after DeepSpeed's own load. A resume on another number of ranks
gives every rank rank 0's buffers, as DDP's broadcast from rank 0 before each forward does.
"""
import hashlib
import os

import deepspeed.comm as dist
import torch

FROZEN_DIR = ".frozen"


# ---------------------------------------------------------------------------------- buffers
def persistent_buffers(module):
    """Name -> buffer, for the buffers a state_dict holds (registered, not ``persistent=False``)."""
    out = {}
    for prefix, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def buffers_of(engines):
    """{engine name: {buffer name: CPU copy}}: what ``buffers/rank<r>.pt`` holds."""
    return {name: {k: b.detach().cpu().clone() for k, b in persistent_buffers(e.module).items()}
            for name, e in engines.items()}


def restore_buffers(engines, saved, source):
    """Copy ``saved`` (from :func:`buffers_of`) into the engines' buffers; returns None or what differs."""
    for name, e in engines.items():
        have, want = persistent_buffers(e.module), saved.get(name, {})
        if set(have) != set(want):
            return (f"engine {name!r} ({type(e.module).__name__}) has buffers {sorted(set(have) - set(want))[:4]} "
                    f"that {source} lacks, and lacks {sorted(set(want) - set(have))[:4]}; build the module as it "
                    "was saved.")
        for k, buf in have.items():
            value = want[k]
            if value.shape != buf.shape or value.dtype != buf.dtype:
                return (f"engine {name!r} buffer {k!r} is {buf.dtype} {tuple(buf.shape)}, {source} holds "
                        f"{value.dtype} {tuple(value.shape)}; build the module as it was saved.")
            with torch.no_grad():
                buf.copy_(value.to(buf.device))
    return None


# ---------------------------------------------------------------------------------- frozen parameters
def object_path(root, digest):
    return os.path.join(root, FROZEN_DIR, f"{digest}.pt")


def referenced_objects(root, manifest):
    """The paths of the frozen-state objects a manifest references (every disk's, every rank's)."""
    return {object_path(root, d) for e in manifest["engines"].values() if e.get("frozen")
            for d in e["frozen"]["ranks"]}


def _layout(engine):
    return "zero3" if engine.zero_optimization_partition_weights() else "full"


def _rank_state(engine):
    """This rank's parameter state: ``{"tensors": name -> CPU tensor}``, and at ZeRO-3 the full shapes
    of the partitioned parameters. On CPU the tensors are the parameters' own (hashing reads them;
    :func:`_owned` copies what is written)."""
    params = list(engine.module.named_parameters())
    if _layout(engine) == "full":
        return {"tensors": {n: p.detach().cpu() for n, p in params}}
    offload = engine._config.zero_config.offload_param
    if offload is not None and str(offload.device).endswith("nvme"):
        raise NotImplementedError(
            f"deepspeed_multi.save_checkpoint: engine {engine._engine_name()} has no optimizer and offloads its "
            "parameters to NVMe (offload_param.device: nvme); its parameters cannot be read back for the checkpoint. "
            "Offload them to cpu, or build it with an optimizer so that DeepSpeed saves it.")
    return {"tensors": {n: p.ds_tensor.detach().cpu() for n, p in params},
            "shapes": {n: list(p.ds_shape) for n, p in params}}


def _owned(state):
    """``state`` with tensors of their own (torch.save writes a view's whole storage)."""
    return dict(state, tensors={n: t.clone() for n, t in state["tensors"].items()})


def _digest(state):
    h = hashlib.sha256()
    for name, t in state["tensors"].items():
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0{state.get('shapes', {}).get(name)}\0".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def save_frozen(root, name, engine, disks):
    """Store this engine's parameters (collective); returns its manifest record and the digests this
    rank's disk holds. See [Note: frozen engines change]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = _rank_state(engine)
    digest = _digest(state)
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    mine = disks.ranks_of(disks.disk_of(rank))
    if rank == min(r for r in mine if digests[r] == digest):  # the first rank of this disk that holds it
        path = object_path(root, digest)
        if not os.path.isfile(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save(_owned(state), tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    record = {"layout": _layout(engine), "ranks": digests}
    return record, sorted({digests[r] for r in mine})


def missing_objects(root, digests):
    """The objects of ``digests`` that ``root`` lacks, as paths relative to it (a tag's manifest lists
    the ones its disk holds; a resize reads every saved rank's, which on node-local disks are spread
    over the nodes' copies)."""
    return sorted({os.path.relpath(object_path(root, d), root) for d in digests
                   if not os.path.isfile(object_path(root, d))})


def _read_object(root, digest):
    path = object_path(root, digest)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing")
    state = torch.load(path, weights_only=True)
    if _digest(state) != digest:
        raise ValueError(f"{path} is damaged (its tensors' sha256 is not its name)")
    return state


def load_frozen(root, name, engine, record, resized):
    """Restore this engine's parameters from the objects ``record`` names; returns None or the error
    (the caller raises it on every rank)."""
    layout = _layout(engine)
    if record["layout"] != layout:
        return f"engine {name!r} was saved with {record['layout']} parameters, given {layout}; build it as it was saved."
    try:
        if layout == "full" or not resized:
            state = _read_object(root, record["ranks"][0 if resized else dist.get_rank()])
        else:
            state = _reassemble([_read_object(root, d) for d in record["ranks"]])
    except (OSError, ValueError, RuntimeError) as e:
        return f"engine {name!r}: frozen-state object {e}"
    return _apply_params(name, engine, state, resized and layout == "zero3")


def _apply_params(name, engine, state, reassembled):
    params = dict(engine.module.named_parameters())
    saved = set(state["tensors"])
    if set(params) != saved:
        return (f"engine {name!r} ({type(engine.module).__name__}) has parameters {sorted(set(params) - saved)[:4]} "
                f"the checkpoint lacks, and lacks {sorted(saved - set(params))[:4]}; build the module as it was saved.")
    if _layout(engine) == "zero3":
        return _load_partitions(name, params, state, reassembled)
    with torch.no_grad():
        for n, p in params.items():
            value = state["tensors"][n]
            if value.shape != p.shape:
                return f"engine {name!r} parameter {n!r} is {tuple(p.shape)}, saved {tuple(value.shape)}."
            p.data.copy_(value.to(p.device, p.dtype))
    return None


# ---------------------------------------------------------------------------------- one engine
def save_engine_state(engine, directory):
    """Outside a set checkpoint (Accelerate's ``save_state`` saves engine by engine): this rank's
    buffers of ``engine``, and its parameters when it has no optimizer, in ``directory``."""
    state = {"world_size": dist.get_world_size(), "buffers": buffers_of({"": engine})[""]}
    if not engine.has_optimizer:
        state["params"] = _owned(_rank_state(engine))
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, f"dsm_module_state_rank{dist.get_rank()}.pt"))


def load_engine_state(engine, directory, name):
    """What :func:`save_engine_state` saved, back into ``engine``; returns None or the error."""
    path = os.path.join(directory, f"dsm_module_state_rank{dist.get_rank()}.pt")
    if not os.path.isfile(path):
        return f"{path} is missing: engine {name!r} was not saved by this deepspeed_multi's save_state."
    state = torch.load(path, weights_only=True)
    if state["world_size"] != dist.get_world_size():
        return (f"{path} was saved by {state['world_size']} ranks, this job has {dist.get_world_size()}; resume on "
                "as many ranks (deepspeed_multi.save_checkpoint's set checkpoint resumes on another number).")
    error = restore_buffers({name: engine}, {name: state["buffers"]}, path)
    if error is None and not engine.has_optimizer:
        if ("shapes" in state["params"]) != (_layout(engine) == "zero3"):
            return f"engine {name!r} was saved at another ZeRO stage (3 or not); build it as it was saved."
        error = _apply_params(name, engine, state["params"], reassembled=False)
    return error


def _reassemble(states):
    """A state of full flat parameters from every saved rank's ZeRO-3 partitions (a resume at another
    world size): each tensor is the saved partitions one after another, padding at the end."""
    return dict(states[0], tensors={n: torch.cat([s["tensors"][n].reshape(-1) for s in states])
                                    for n in states[0]["tensors"]})


def _load_partitions(name, params, state, resized):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    available = []
    for n, p in params.items():
        if getattr(p, "ds_secondary_tensor", None) is not None:
            # Its gathers read the hpZ copy, which this write to the partition would leave stale.
            return (f"engine {name!r} parameter {n!r} has an hpZ secondary partition (zero_hpz_partition_size > 1): "
                    "loading a frozen ZeRO-3 engine's parameters with hpZ is not supported. Build that engine without "
                    "zero_hpz_partition_size (a frozen engine gathers nothing in a backward, where hpZ saves).")
        part, value, shape = p.ds_tensor, state["tensors"][n], state["shapes"][n]
        if list(p.ds_shape) != shape:
            return f"engine {name!r} parameter {n!r} is {tuple(p.ds_shape)}, saved {tuple(shape)}."
        if resized:  # this rank's partition, cut out of the reassembled parameter
            start = dist.get_rank(group=p.ds_process_group) * part.numel()
            piece = value[start:min(start + part.numel(), p.ds_numel)]
            value = torch.zeros(part.numel(), dtype=piece.dtype)
            value[:piece.numel()] = piece
        elif value.numel() != part.numel():
            return f"engine {name!r} parameter {n!r}: partition of {part.numel()} elements, saved {value.numel()}."
        part.data.copy_(value.reshape(part.shape).to(part.device, part.dtype))
        if p.ds_status == ZeroParamStatus.AVAILABLE:
            available.append(p)  # a persistent parameter: its gathered copy is stale now
    if available:
        available[0].partition(param_list=available, has_been_updated=False)  # the next forward gathers anew
    return None
