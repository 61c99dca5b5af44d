"""Which ranks share which copy of a checkpoint directory, on one disk or on each node's own disk.

See [Note: node-local storage] in set_checkpoint.py: the probe that tells a shared filesystem from a disk
per node, the files that travel from rank 0's disk to the others, and the choice, before anything is
loaded, of the tag every disk holds (or the error that names the node lacking it).
"""
import logging
import os
import re
import secrets
import socket

import deepspeed.comm as dist

from ..reliability.watchdog import node_index

logger = logging.getLogger("deepspeed_multi.checkpoint")
LATEST = "latest"

# Files written by one rank for itself (see [Note: node-local storage]); everything else is common.
_PER_RANK = re.compile(r"(^|/)((rng|buffers)/rank(?P<a>\d+)\.pt|(bf16_)?zero_pp_rank_(?P<b>\d+)_mp_rank_\d+_(optim|model)_states\.pt)$")


def _owner(relpath):
    """The rank a per-rank file belongs to, or None for a file every rank reads."""
    m = _PER_RANK.search(relpath)
    return None if m is None else int(m.group("a") or m.group("b"))


def _node_key():
    """What tells this rank's node from the others: the host name and, where the launcher sets one,
    its node index."""
    return f"{socket.gethostname()}/{node_index() or ''}"


class _Disks:
    """Which ranks see which copy of a directory: ``nodes`` (lists of ranks, by first rank) and
    ``disks`` (lists of node indexes; disk 0 is rank 0's)."""

    def __init__(self, nodes, disks, world):
        self.nodes, self.disks = nodes, disks
        self._node = {r: n for n, ranks in enumerate(nodes) for r in ranks}
        self._disk = {r: d for d, ns in enumerate(disks) for n in ns for r in nodes[n]}
        self.shared = len(disks) == 1

    @classmethod
    def single(cls, world):
        return cls([list(range(world))], [[0]], world)

    @classmethod
    def probe(cls, directory, create):
        rank, world = dist.get_rank(), dist.get_world_size()
        infos = [None] * world
        dist.all_gather_object(infos, (_node_key(), secrets.token_hex(8) if rank == 0 else None))
        keys, token = [k for k, _ in infos], infos[0][1]
        order = list(dict.fromkeys(keys))
        nodes = [[r for r in range(world) if keys[r] == k] for k in order]
        if len(nodes) == 1:
            return cls(nodes, [[0]], world)
        node = order.index(keys[rank])
        first = nodes[node][0] == rank
        probe = os.path.join(directory, f".dsm_probe.{token}.{node}")
        if first and (create or os.path.isdir(directory)):
            os.makedirs(directory, exist_ok=True)
            with open(probe, "w"):
                pass
        dist.barrier()
        seen = None
        if first:
            prefix = f".dsm_probe.{token}."
            seen = sorted(int(f[len(prefix):]) for f in os.listdir(directory)
                          if f.startswith(prefix)) if os.path.isdir(directory) else [node]
        seens = [None] * world
        dist.all_gather_object(seens, seen)
        if first and os.path.exists(probe):
            os.remove(probe)
        groups = {}
        for n, ranks in enumerate(nodes):
            groups.setdefault(tuple(seens[ranks[0]]), []).append(n)
        return cls(nodes, sorted(groups.values()), world)

    def disk_of(self, rank):
        return self._disk[rank]

    def ranks_of(self, disk):
        return sorted(r for n in self.disks[disk] for r in self.nodes[n])

    def leader(self, disk):
        return self.ranks_of(disk)[0]

    def leads(self, rank):
        return self.leader(self.disk_of(rank)) == rank

    def name_disk(self, disk):
        return " and ".join(self.name_node(n) for n in self.disks[disk])

    def name_node(self, n):
        ranks = self.nodes[n]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(
            range(ranks[0], ranks[-1] + 1)) else f"ranks {ranks}"
        return f"node {n} ({span})"

    def on_disk_of(self, rank):
        return "" if self.shared else f" on the disk of {self.name_disk(self.disk_of(rank))}"

    def describe(self, sums):
        """The manifest's "storage" entry: which nodes and ranks hold which disk, and its files."""
        return {"node_local": not self.shared, "nodes": [{"node": n, "ranks": r} for n, r in enumerate(self.nodes)],
                "disks": [{"nodes": ns, "ranks": self.ranks_of(d), "files": sorted(sums[d])}
                          for d, ns in enumerate(self.disks)]}


def _copy_common_files(staging, disks):
    """Send the files rank 0's disk holds that are no rank's own to every other disk's first rank that
    lacks them (an engine with DeepSpeed's ``checkpoint.use_node_local_storage`` already wrote its
    model states on every node). They travel through the process group, in memory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listing = [None] * world
    mine = None
    if disks.leads(rank):
        mine = {os.path.relpath(os.path.join(d, f), staging) for d, _, fs in os.walk(staging) for f in fs}
    dist.all_gather_object(listing, mine)
    payload = [None]
    if rank == 0:
        others = [listing[disks.leader(d)] for d in range(1, len(disks.disks))]
        payload = [{}]
        for rel in sorted(listing[0]):
            if _owner(rel) is None and any(rel not in other for other in others):
                with open(os.path.join(staging, rel), "rb") as fh:
                    payload[0][rel] = fh.read()
    dist.broadcast_object_list(payload, src=0)
    if disks.leads(rank) and disks.disk_of(rank) != 0:
        for rel, data in payload[0].items():
            if rel in mine:
                continue
            os.makedirs(os.path.dirname(os.path.join(staging, rel)), exist_ok=True)
            with open(os.path.join(staging, rel), "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
    dist.barrier()


def _needed_by(rank, world):
    """The per-rank files ``rank`` reads at a same-size resume (besides the common ones)."""
    return [f"rng/rank{rank}.pt", f"buffers/rank{rank}.pt"]


def _holders_text(manifest):
    storage = manifest.get("storage")
    if not storage or not storage.get("node_local"):
        return "one disk"
    return "; ".join(f"nodes {d['nodes']} (ranks {d['ranks']}) hold one copy" for d in storage["disks"])


def _choose_on_every_disk(load_dir, tag, views, disks):
    """The manifest to load on each disk (a list by disk), or FileNotFoundError naming the node and tag."""
    for view in views:
        for path, why in view["incomplete"]:
            logger.warning("deepspeed_multi.load_checkpoint: ignoring incomplete checkpoint %s (%s); "
                           "deepspeed_multi.checkpoint.remove_incomplete(%r) deletes it.", path, why, load_dir)

    def holds(d):
        tags = sorted(views[d]["complete"], key=lambda t: views[d]["complete"][t]["serial"])
        return f"holds {tags}" if tags else "holds no complete checkpoint"

    def lacking(wanted, why):
        lines = [f"{disks.name_disk(d)} has no complete checkpoint {wanted!r} in {load_dir} (it {holds(d)})"
                 for d, v in enumerate(views) if wanted not in v["complete"]]
        others = [f"{disks.name_disk(d)} {holds(d)}" for d, v in enumerate(views) if wanted in v["complete"]]
        return FileNotFoundError(
            "; ".join(lines) + (f", while {'; '.join(others)}" if others else "") + f" ({why}). Nothing was loaded. "
            "On node-local storage every node needs its own copy: restore that node's copy of the tag, or pass an "
            "older tag= that every node holds.")

    if tag is not None:
        tag = str(tag)
        if any(tag not in v["complete"] for v in views):
            if len(views) == 1:
                raise FileNotFoundError(f"no complete checkpoint with tag {tag!r} in {load_dir} (complete tags: "
                                        f"{sorted(views[0]['complete'])})")
            raise lacking(tag, "asked for by tag=")
    else:
        if not any(v["complete"] for v in views):
            raise FileNotFoundError(f"no complete deepspeed_multi checkpoint in {load_dir}")
        # A tag any disk's `latest` names was published on every disk (the save's second step).
        for v in views:
            named = v["latest"]
            if named in v["complete"] and any(named not in w["complete"] for w in views):
                raise lacking(named, f"{LATEST} on another node names it, so it was saved on every node")
        common = set.intersection(*(set(v["complete"]) for v in views))
        if not common:
            raise lacking(max(views[0]["complete"], key=lambda t: views[0]["complete"][t]["serial"]),
                          "no tag is complete on every node")
        tag = max(common, key=lambda t: views[0]["complete"][t]["serial"])
        newest = max((m["serial"], t) for v in views for t, m in v["complete"].items())
        if newest[1] != tag:
            logger.warning("deepspeed_multi.load_checkpoint: %r is complete on some nodes' disks only (a save that "
                           "ended between the disks' renames) or newer than %s names; loading %r, the newest tag "
                           "complete on every disk.", newest[1], LATEST, tag)
    chosen = [v["complete"][tag] for v in views]
    if len({(m["serial"], m.get("save_id")) for m in chosen}) != 1:
        raise ValueError(f"the copies of {tag!r} on the nodes' disks are of different saves: "
                         f"{[(m['serial'], m.get('saved_at')) for m in chosen]}")
    return chosen
