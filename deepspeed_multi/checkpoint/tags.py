"""The tags of a checkpoint directory: which are complete, which to load, and their removal.

A tag is complete when its ``manifest.json`` is valid and every file it lists is there, in the tag
and in the frozen-state store beside it (see [Note: frozen engines change] in module_state.py).
Anything else that looks like a set checkpoint is incomplete: a staging directory left by a save
that was killed, a tag whose manifest is damaged. Other directories are not ours to judge.
"""
import json
import logging
import os
import shutil

from .disks import LATEST
from .module_state import FROZEN_DIR, missing_objects, referenced_objects

logger = logging.getLogger("deepspeed_multi.checkpoint")

FORMAT = "deepspeed_multi.checkpoint/2"
MANIFEST = "manifest.json"
STAGING = ".{tag}.staging"


def read_manifest(path):
    """``(manifest, None)`` for a complete tag directory, ``(None, why)`` otherwise."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"no valid {MANIFEST}: {type(e).__name__}"
    if manifest.get("format") != FORMAT:
        return None, (f"{MANIFEST} has format {manifest.get('format')!r}, expected {FORMAT!r} (a checkpoint of "
                      "another deepspeed_multi release: load it with that release)")
    missing = [f for f in manifest["files"] if not os.path.isfile(os.path.join(path, f))]
    missing += missing_objects(os.path.dirname(path), manifest.get("objects", []))
    if missing:
        return None, f"files listed in {MANIFEST} are missing: {missing[:3]}"
    return manifest, None


def complete_tags(directory):
    """``([(serial, manifest)], [(path, why incomplete)])`` for the checkpoints under ``directory``.

    A tag directory whose manifest is unreadable or lists missing files is incomplete; other
    directories (an engine's own DeepSpeed checkpoint, the frozen-state store, anything else) are
    left out silently.
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
        manifest, why = read_manifest(path)
        if manifest is None:
            incomplete.append((path, why))
        else:
            complete.append((manifest["serial"], manifest))
    return complete, incomplete


def choose(load_dir, tag):
    """The manifest one disk loads: ``tag``'s, or the newest complete one (whatever ``latest`` says)."""
    complete, incomplete = complete_tags(load_dir)
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


def disk_view(load_dir):
    """What one disk holds: its complete tags' manifests, what its `latest` names, its incomplete tags."""
    complete, incomplete = complete_tags(load_dir)
    latest = os.path.join(load_dir, LATEST)
    try:
        pointed = open(latest).read().strip() if os.path.isfile(latest) else None
    except OSError:
        pointed = None
    return {"complete": {m["tag"]: m for _, m in complete}, "latest": pointed, "incomplete": incomplete}


def _remove_unreferenced(directory):
    """Delete the frozen-state objects that no complete tag references (left by removed tags and by
    saves that were killed); return their paths."""
    store = os.path.join(directory, FROZEN_DIR)
    if not os.path.isdir(store):
        return []
    kept = set()
    for _, manifest in complete_tags(directory)[0]:
        kept |= referenced_objects(directory, manifest)
    removed = []
    for entry in sorted(os.listdir(store)):
        path = os.path.join(store, entry)
        if path not in kept:
            os.remove(path)
            removed.append(path)
    return removed


def remove_incomplete(directory):
    """Delete the staging directories and tags without a valid manifest under ``directory``, and the
    frozen-state objects no complete tag references; return the paths of the incomplete tags.
    Call from one process (one per disk on node-local storage), while no save is running."""
    removed = []
    for path, _ in complete_tags(directory)[1]:
        shutil.rmtree(path)
        removed.append(path)
    orphans = _remove_unreferenced(directory)
    if orphans:
        logger.info("deepspeed_multi.checkpoint: removed %d frozen-state object(s) no tag references", len(orphans))
    return removed


def remove_checkpoint(directory, tag):
    """Delete one set checkpoint and the frozen-engine states only it referenced.

    An unchanged frozen engine's parameters are stored once and referenced by every tag saved while it
    did not change: they stay while another tag references them. Call from one process (one per disk
    on node-local storage), while no save is running. ``latest`` is left alone: a load takes the newest
    complete tag whatever ``latest`` names.

    Args:
        directory (str): the directory that holds the tags.
        tag (str): the checkpoint to delete.

    Returns:
        list: the paths deleted, the tag's first.

    Raises:
        FileNotFoundError: ``<directory>/<tag>`` is not a set checkpoint.
    """
    path = os.path.join(directory, str(tag))
    if read_manifest(path)[0] is None and not os.path.isdir(os.path.join(path, "rng")):
        raise FileNotFoundError(f"deepspeed_multi.checkpoint.remove_checkpoint: {path} is not a set checkpoint.")
    shutil.rmtree(path)
    return [path] + _remove_unreferenced(directory)


def check_name(name, what):
    if not isinstance(name, str) or not name or name.startswith(".") or os.sep in name or name in (MANIFEST, "rng",
                                                                                                  "buffers"):
        raise ValueError(f"deepspeed_multi checkpoint: {what} must be a non-empty directory name without "
                         f"{os.sep!r}, not starting with '.', and not {MANIFEST!r}, 'rng' or 'buffers'; got {name!r}.")


def write_atomically(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
