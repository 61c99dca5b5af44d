"""hpZ's partition group for the engines that configure hpZ only.

[Note: hpZ's group is the config's]
DeepSpeed keeps ZeRO++'s hierarchical partitioning group (``zero_hpz_partition_size``) in a process-wide
global (``deepspeed.utils.groups``), created by the first engine whose config asks for it, and every ZeRO-3
engine built afterwards reads that global at construction whatever its own config says: a frozen reference
or a trained model without hpZ, built after an engine with it, gets secondary partitions too (upstream
DeepSpeed, 0.19.8). Its gathers then read those copies, which a write to the primary partition (a
checkpoint's load of a frozen engine, an EMA or reference sync) leaves stale. So an engine whose config
has no hpZ is built with the global unset, and the global is put back for the engines that have it.
"""
import contextlib


@contextlib.contextmanager
def for_config(config: dict):
    """Around the construction of the engine of ``config``: hide another engine's hpZ group from it."""
    from deepspeed.utils import groups
    zero = config.get("zero_optimization") or {}
    hpz = zero.get("zero_hpz_partition_size", 1) or 1
    saved = getattr(groups, "_ZERO_PARAM_INTRA_PARALLEL_GROUP", None)
    if zero.get("stage") != 3 or hpz > 1 or saved is None:
        yield
        return
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    try:
        yield
    finally:
        if groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is None:
            groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = saved
