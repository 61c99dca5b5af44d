"""What the ranks decide and check together during a save or a load: an error any rank found, a
value every rank must agree on, and the sha256 of every file of a tag, hashed by the ranks of
each disk in shares."""
import hashlib
import os

import deepspeed.comm as dist

from .disks import _Disks


def raise_if_any(error):
    """Every rank raises when any rank found an error (so no rank is left waiting in a collective)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        raise RuntimeError(errors[0])


def same_on_every_rank(value, what):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) != 1:
        raise ValueError(f"deepspeed_multi.save_checkpoint: the {what} differs between ranks: {values}; pass the "
                         "same value on every rank.")
    return value


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checksums(root, expected=None, disks=None):
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
            mine[f] = {"sha256": sha256_of(full), "bytes": os.path.getsize(full)}
        elif not os.path.isfile(full) or sha256_of(full) != expected[f]["sha256"]:
            mine[f] = "missing" if not os.path.isfile(full) else "checksum differs"
    gathered = [None] * world
    dist.all_gather_object(gathered, (disk, mine))
    merged = {}
    for d, part in gathered:
        merged.setdefault(d, {}).update(part)
    if expected is None:
        return {d: dict(sorted(merged.get(d, {}).items())) for d in range(len(disks.disks))}
    return sorted(f"{k} ({v})" for k, v in merged.get(disk, {}).items())
