"""ZeRO-3: prefetches that no forward will consume, drained where none can be.

[Note: draining ZeRO-3's prefetch]
ZeRO-3 prefetches the parameters of the submodule its trace expects next and drains what is left
only at the start of the next forward of the root module. A submodule called outside
engine(...) (the LLaVA embedding) is in that trace, so the last forward of a loop leaves its
prefetch in flight, and the next partition (the update, GatheredParameters, a checkpoint)
fails with "Cannot partition a param in flight"; upstream does the same. MultiEngine drains it
where no compute of the engine runs and none is prefetched for: step(), zero_grad(),
destroy(), the end of a forward no backward can follow (no output requires grad), the end of
every forward of a frozen engine (it has no step(); e.g. its output used detached, then
GatheredParameters), and the end of a backward through a frozen engine. A backward that follows
re-gathers what it needs.
"""
from . import joined_fetch as stage3_joined_fetch


def drain(engine) -> None:
    """Wait for and release ``engine``'s ZeRO-3 prefetches (see the Note); nothing below ZeRO-3."""
    if engine.zero_optimization_stage() == 3:
        coordinator = stage3_joined_fetch.coordinator_of(engine.optimizer)
        coordinator._clean_inflight_param_registry()
        stage3_joined_fetch.release_pending(coordinator)  # [Note: one fetch for several engines' forwards]


def after_frozen_backward(engine) -> None:
    """The end of a backward through a frozen ZeRO-3 engine: what the optimizer epilogue it lacks would do.

    That epilogue's last act releases the submodules whose post-backward release never fired (a module
    called twice in one forward); without it they stay gathered and a later release refuses to free them."""
    engine.optimizer.release_backward_leftovers()
    drain(engine)
