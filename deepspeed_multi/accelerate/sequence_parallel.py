"""Accelerate's DeepSpeed sequence parallelism (``ParallelismConfig(sp_backend="deepspeed")``) over several models.

[Note: one Ulysses registration for every model]
Accelerate's ``_prepare_deepspeed`` calls ``UlyssesSPAttentionHF.register_with_transformers`` for each
model it prepares under sequence parallelism. That call builds DeepSpeed's process-wide
sequence-parallel groups (a second build fails: "sequence parallel group is already initialized") and
replaces the process-wide attention function of the model's ``attn_implementation`` with the Ulysses
wrapper around the current one (a second replacement would wrap the wrapper: two all-to-alls). Every
model prepared on the same ranks shares the groups and the wrapper, as in DeepSpeed's own multi-model
examples, so later models get the mpu of the first registration. A later model whose attention has
other head counts is refused by the wrapper's shape checks at its first forward, not silently run.
"""
import contextlib
import functools


@contextlib.contextmanager
def register_once():
    """Around one ``Accelerator._prepare_deepspeed`` call."""
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except ImportError:  # a DeepSpeed without ALST: Accelerate refuses sp_size > 1 itself
        yield
        return
    original = UlyssesSPAttentionHF.__dict__["register_with_transformers"]

    @functools.wraps(original.__func__)
    def registered_once(cls, *args, **kwargs):
        size = kwargs.get("sequence_parallel_size", args[2] if len(args) > 2 else None)
        if size is None or size <= 1 or parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
            return original.__func__(cls, *args, **kwargs)
        if parallel_state_sp.get_sequence_parallel_world_size() != size:
            raise ValueError(f"deepspeed_multi: this model is prepared with sequence_parallel_size {size}, but the "
                             "models prepared before it built DeepSpeed's sequence-parallel groups of size "
                             f"{parallel_state_sp.get_sequence_parallel_world_size()}; every model on these ranks "
                             "shares them. Use one sp_size for every model.")
        return parallel_state_sp

    UlyssesSPAttentionHF.register_with_transformers = classmethod(registered_once)
    try:
        yield
    finally:
        UlyssesSPAttentionHF.register_with_transformers = original
