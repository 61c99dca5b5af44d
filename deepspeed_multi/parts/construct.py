"""Building a model whose parts have different ZeRO stages: only the ZeRO-3 parts stay partitioned.

[Note: constructing a parted model]
``deepspeed.zero.Init`` partitions each module's parameters as soon as that module's ``__init__``
returns, long before the module is given the name (``language_model``) that decides its part: a
Linear deep inside the LLM is built, and must be partitioned, before the LLM is assigned to the
model. So :func:`zero_init_parts` builds the whole model under one ``zero.Init`` with the ZeRO-3
parts' config (no ZeRO-3 part is ever whole on a rank), and when the block ends, with every name
known, gathers the parameters of the parts that are not ZeRO-3 back into plain parameters, one
module at a time, in their part's dtype (they are small by premise, and every rank holds them
whole after ``initialize`` anyway). Transformers models built in the block (``from_config``,
``from_pretrained``) see the ZeRO-3 parts' config, so they are partitioned and loaded the way
Transformers does under ZeRO-3, then the same gather applies.

What this costs against building plainly: a non-ZeRO-3 part is created in the ZeRO-3 parts' dtype
(DeepSpeed's tensor overrides are process-wide while the block runs), so a fp32 part beside a
bf16 ZeRO-3 part starts from bf16-rounded initial values; weights loaded by ``from_pretrained``
are loaded in that dtype as well. Refused: ZeRO-3 parts of different dtypes (one ``zero.Init``
creates every tensor), and a module built in the block that is not a model with the declared
submodules (it would be left partitioned at the ZeRO-3 config whatever engine it goes to).
"""
import contextlib
import gc
import weakref

import deepspeed
import torch
import torch.nn as nn

from ..config import enabled, zero_stage
from .plan import REST, Plan, declared_configs


class _RecordingInit(deepspeed.zero.Init):
    """``zero.Init`` that keeps the modules it built, to find the model(s) at the end of the block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built = []  # weak: a module built and dropped in the block (a replaced embedding) is no model

    def _post_init_method(self, module):
        super()._post_init_method(module)
        self.built.append(weakref.ref(module))


def _dtype(config) -> torch.dtype:
    if enabled(config.get("bf16")):
        return torch.bfloat16
    if enabled(config.get("fp16")):
        return torch.float16
    return torch.float32


@contextlib.contextmanager
def zero_init_parts(config: dict, declared: dict, **init_kwargs):
    """``deepspeed_multi.zero_init`` for a config that declares submodules (see the module Note)."""
    from ..integrations.hf_config import hf_deepspeed_config
    configs = {**declared_configs(config, declared), REST: config}  # before the model exists
    zero3 = {name: cfg for name, cfg in configs.items() if zero_stage(cfg) == 3}
    if not zero3:
        with hf_deepspeed_config(None):
            yield
        return
    dtypes = {name: _dtype(cfg) for name, cfg in zero3.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"deepspeed_multi.zero_init: the ZeRO-3 parts {sorted(dtypes)} have different dtypes "
                         f"({ {n: str(d) for n, d in dtypes.items()} }); one zero.Init creates every tensor of the "
                         "block in one dtype. Give them one precision, or build the model outside zero_init.")
    init_config = {k: v for k, v in next(iter(zero3.values())).items() if k != "deepspeed_multi"}
    init = _RecordingInit(config_dict_or_path=init_config, **init_kwargs)
    with hf_deepspeed_config(init_config), init:
        yield
    _gather_non_zero3_parts(init.built, config, declared)


def _gather_non_zero3_parts(built, config, declared):
    gc.collect()
    built = [m for m in (ref() for ref in built) if m is not None]
    children = {id(c) for m in built for c in m.children()}
    # Modules with no parameters (an activation a library keeps) have nothing to give back.
    roots = [m for m in built if id(m) not in children and any(True for _ in m.parameters())]
    for root in roots:
        missing = [name for name in declared if not _has_submodule(root, name)]
        if missing:
            raise ValueError(f"deepspeed_multi.zero_init: {type(root).__name__} was built in the block but has no "
                             f"submodule {missing[0]!r} of the declared {sorted(declared)}; its parameters would stay "
                             "partitioned at the ZeRO-3 parts' config whichever part they join. Build only the model "
                             "(with everything it holds) inside the block, and other modules outside it.")
        gather_non_zero3(root, Plan(root, config, declared))


def gather_non_zero3(model, plan) -> dict:
    """Make the partitioned parameters of ``model``'s parts that are not ZeRO-3 plain parameters again,
    in their part's dtype; return {id(old parameter): new parameter}. Also for a model Transformers
    built under ZeRO-3 as a whole (``TrainingArguments(deepspeed=...)`` with a top-level stage 3):
    initialize calls this."""
    dtypes = {name: _dtype(cfg) for name, cfg in plan.configs.items()}
    owner = plan.owner_of()
    plain = {}  # id(partitioned parameter) -> its plain replacement (ties inside a part stay tied)
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is None or not hasattr(p, "ds_id") or zero_stage(plan.configs[owner[id(p)]]) == 3:
                continue
            if id(p) not in plain:
                with deepspeed.zero.GatheredParameters([p]):
                    data = p.data.detach().clone().to(dtypes[owner[id(p)]])
                plain[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[pname] = plain[id(p)]
    return plain


def _has_submodule(root, name) -> bool:
    try:
        root.get_submodule(name)
        return True
    except AttributeError:
        return False
