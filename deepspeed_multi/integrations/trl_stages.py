"""TRL's "is DeepSpeed at ZeRO-3?" checks, answered per model for trainers whose models differ.

[Note: TRL's one-config checks]
TRL asks whether DeepSpeed is at ZeRO-3 from the one process-wide config (the policy's) in two
places where the answer depends on whose parameters it is about to touch:

* ``trl.trainer.utils.maybe_gather_lm_head_ctx``: the fused losses (DistillationTrainer's chunked
  divergence, the chunked log-probs) read ``lm_head.weight`` outside the head's forward and
  gather it only when ``is_deepspeed_zero3_enabled()``. A ZeRO-3 teacher beside a ZeRO-2 student
  hands the kernel an empty partition (``RuntimeError: mat2 must be a matrix``); a head that is not
  ZeRO-3 beside a ZeRO-3 policy has no ``ds_status`` (AttributeError).
* ``SyncRefModelCallback.sync_target_model`` (``sync_ref_model=True``): gathers both models and
  updates on rank 0 when the policy's plugin is at ZeRO-3, else updates in place. A ZeRO-3
  reference beside a ZeRO-2 policy is then updated on its empty partitions; a reference that is
  not ZeRO-3 beside a ZeRO-3 policy is updated on rank 0 only, so the ranks' references drift.

For a trainer built by ``multi_engine_trainer`` both decide per parameter and call TRL's own code
for the rest: the lm_head gather is TRL's, given only the ZeRO-3 parameters, while a trainer
trains, evaluates or predicts (:func:`per_model_zero3`); the sync callback of each such trainer
(:func:`fix_sync_callbacks`) gathers the source's ZeRO-3 parameters to read and the target's with
rank 0 as the modifier, and runs TRL's ``_sync_target_model`` on every rank (each rank computes
the same update; for a target that is not ZeRO-3 each rank's replica needs it).
"""
import contextlib
import sys

from .. import compat


def _zero3(params):
    """The ZeRO-3 parameters among ``params``, each once."""
    return list({id(p): p for p in params if p is not None and hasattr(p, "ds_id")}.values())


def _lm_head_ctx(original):
    def maybe_gather_lm_head_ctx(*params):
        import transformers.integrations.deepspeed as hf_ds
        zero3 = _zero3(params)
        if not zero3:
            return contextlib.nullcontext()
        with compat.swapped(hf_ds, "is_deepspeed_zero3_enabled", lambda: True):
            return original(*zero3)
    maybe_gather_lm_head_ctx._dsm_original = original
    return maybe_gather_lm_head_ctx


@contextlib.contextmanager
def per_model_zero3():
    """Within the block, TRL's lm_head gather decides per parameter (see the Note); nothing if TRL
    is not imported."""
    utils = sys.modules.get("trl.trainer.utils")
    original = getattr(utils, "maybe_gather_lm_head_ctx", None)
    if original is None or hasattr(original, "_dsm_original"):
        yield
        return
    ours = _lm_head_ctx(original)
    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "trl" and getattr(module, "maybe_gather_lm_head_ctx", None) is original:
                stack.enter_context(compat.swapped(module, "maybe_gather_lm_head_ctx", ours))
        yield


def _sync_target_model(callback_cls):
    def sync_target_model(model, target_model, alpha):
        import deepspeed
        source, target = _zero3(model.parameters()), _zero3(target_model.parameters())
        with deepspeed.zero.GatheredParameters(source, modifier_rank=None, enabled=bool(source)), \
                deepspeed.zero.GatheredParameters(target, modifier_rank=0, enabled=bool(target)):
            callback_cls._sync_target_model(model, target_model, alpha)
    return sync_target_model


def fix_sync_callbacks(trainer) -> None:
    """Each ``SyncRefModelCallback`` of ``trainer`` syncs per parameter (see the Note)."""
    callbacks = sys.modules.get("trl.trainer.callbacks")
    cls = getattr(callbacks, "SyncRefModelCallback", None)
    if cls is None:
        return
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, cls):
            callback.sync_target_model = _sync_target_model(cls)
