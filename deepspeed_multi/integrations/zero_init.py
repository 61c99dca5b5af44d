"""Build models for mixed ZeRO stages side by side (the RFC's second challenge).

``with deepspeed_multi.zero_init(config):`` partitions parameters at construction when
``config`` is a ZeRO stage-3 config and does nothing otherwise, so a ZeRO-3 teacher and a
ZeRO-2 student can be built one after the other without toggling global state by hand.

[Note: Transformers models under zero_init]
Transformers' ``from_pretrained``/``from_config`` decide on ``zero.Init`` from a process-wide
config (``HfDeepSpeedConfig``), not from the context they run in. Inside ``zero_init`` that
global config is this block's config for a stage-3 config, and unset for any other stage, and
whatever was there before (an Accelerate plugin's config) comes back on exit. So a stage-3 block
makes Transformers partition (and initialise the weights on the gathered parameters, as it does
under ZeRO-3), and a stage-2 block right after builds a plain model, whatever was selected before.
"""
import contextlib
import copy

import deepspeed

from ..config import load_config, zero_stage
from ..parts.construct import zero_init_parts
from ..parts.plan import declared_submodules
from .hf_config import hf_deepspeed_config


@contextlib.contextmanager
def zero_init(config, **init_kwargs):
    """A context manager: models built inside it are partitioned at construction under a ZeRO-3 config.

    Under another stage the block builds plain modules. Transformers models built in the block follow
    the same config ([Note: Transformers models under zero_init]); a config that declares submodules
    at other stages partitions only its ZeRO-3 parts ([Note: constructing a parted model]).

    Args:
        config (dict or str): the DeepSpeed config the model's engine will be built with, or its path.
        **init_kwargs: passed to ``deepspeed.zero.Init`` (e.g. ``remote_device``, ``dtype``).

    Yields:
        None: build the model inside the ``with`` block.
    """
    config = copy.deepcopy(load_config(config))
    # zero.Init replaces torch.Tensor.__new__ for the block; torch._dynamo checks the signatures of
    # what it wraps when first imported (as a lazily imported Transformers model does), and fails
    # on DeepSpeed's replacement. Imported here, before the block, it is never first imported inside.
    import torch._dynamo  # noqa: F401
    declared = declared_submodules(config)
    if declared is not None:  # one model, several ZeRO stages: see [Note: constructing a parted model]
        with zero_init_parts(config, declared, **init_kwargs):
            yield
        return
    if zero_stage(config) != 3:
        with hf_deepspeed_config(None):
            yield
        return
    with hf_deepspeed_config(config), deepspeed.zero.Init(config_dict_or_path=config, **init_kwargs):
        yield
