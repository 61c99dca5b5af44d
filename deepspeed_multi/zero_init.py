"""Build models for mixed ZeRO stages side by side (the RFC's second challenge).

``with deepspeed_multi.zero_init(config):`` partitions parameters at construction when
``config`` is a ZeRO stage-3 config and does nothing otherwise, so a ZeRO-3 teacher and a
ZeRO-2 student can be built one after the other without toggling global state by hand.
"""
import contextlib

import deepspeed

from .config import load_config, zero_stage


def zero_init(config, **init_kwargs):
    """Return ``deepspeed.zero.Init`` for a stage-3 config, else a context that does nothing.

    ``config`` is a DeepSpeed config dict or a path to one. Extra keyword arguments go to
    ``deepspeed.zero.Init`` (e.g. ``remote_device``, ``dtype``).
    """
    config = load_config(config)
    if zero_stage(config) != 3:
        return contextlib.nullcontext()
    return deepspeed.zero.Init(config_dict_or_path=config, **init_kwargs)
