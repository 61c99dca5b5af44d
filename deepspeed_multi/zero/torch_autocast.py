"""DeepSpeed's torch_autocast, scoped to the engines whose configs turn it on.

[Note: torch_autocast is per engine]
DeepSpeed records torch_autocast in module globals (``deepspeed.runtime.torch_autocast``): the first
engine built with it sets ``TORCH_AUTOCAST_INITIALIZED``, and from then on every ZeRO optimizer built
in the process, with or without torch_autocast in its own config, keys its gradient buckets by each
parameter's autocast communication dtype instead of its ``communication_data_type``, and in fp16 gets
a GradScaler of its own. In a program of several engines that means: an engine built after an fp16
torch_autocast engine scales and unscales its gradients by a GradScaler it was never configured with
(a Muon engine's orthogonalized update, which ignores the loss scale, is then divided by the scale:
65536x too small), and a bf16 engine's ``communication_data_type: fp32`` stops applying. Upstream does
the same with ``engine.backward``. ``scoped`` builds an engine without torch_autocast as if no engine
had turned it on, and keeps its optimizer on its own communication dtype afterwards.
"""
import contextlib

import deepspeed.runtime.torch_autocast as ds_autocast


def enabled(config: dict) -> bool:
    return bool((config.get("torch_autocast") or {}).get("enabled", False))


@contextlib.contextmanager
def scoped(config: dict):
    """Around ``deepspeed.initialize`` of one engine; ``keep_own_comm_dtype`` after it."""
    if enabled(config) or not ds_autocast.TORCH_AUTOCAST_INITIALIZED:
        yield
        return
    ds_autocast.TORCH_AUTOCAST_INITIALIZED = False
    try:
        yield
    finally:
        ds_autocast.TORCH_AUTOCAST_INITIALIZED = True


def keep_own_comm_dtype(engine, config: dict) -> None:
    """An engine without torch_autocast reduces in its own communication dtype whatever other engines set."""
    optimizer = engine.optimizer
    if enabled(config) or not hasattr(optimizer, "get_param_comm_dtype"):
        return
    optimizer.get_param_comm_dtype = lambda param: optimizer.communication_data_type  # its buckets' one key
