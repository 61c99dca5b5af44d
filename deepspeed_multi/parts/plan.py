"""Which parameters of one model each part owns, and each part's DeepSpeed config.

[Note: one model, several ZeRO stages]
A config may declare named submodules of the model, each with its own DeepSpeed settings::

    "deepspeed_multi": {"submodules": {
        "language_model": {"zero_optimization": {"stage": 3}},
        "vision_tower": {"zero_optimization": {"stage": 2}}}}

Each declared submodule becomes one part; what no declaration covers (a projector, parameters
held directly by a module above a declared one) is the rest, trained under the top-level config.
Every part is a MultiEngine over the submodule itself (the rest: over a container that holds
references to its modules and parameters), so the model keeps its own attributes, names and
``state_dict()`` keys: the parts are never inserted into it. The model's own forward calls the
submodules as before; each call opens its part's region (autograd/region.py), the same
boundary a submodule called outside ``engine(...)`` gets, so one ``loss.backward()`` runs
every part's ZeRO prologue and epilogue (see parts/engine.py for the step).

Refused at initialize, naming the submodules: a declaration that names no submodule, two
declarations one inside the other, a parameter owned by two parts (tied weights across parts:
each part would update its own copy), and a part whose settings the model as a whole must share
(batch geometry and accumulation, clipping, optimizer and scheduler: one optimizer and one
schedule serve every part, and the clip is on the norm of the whole model).
"""
import copy

import torch.nn as nn

from ..config import enabled, merged, zero_stage

SUBMODULES_KEY = "submodules"
REST = "_rest"  # the part of the model no declaration covers (a checkpoint directory name)

# Settings that belong to the model as a whole: a part may repeat them, not change them.
_WHOLE_MODEL = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping")
_ONE_FOR_ALL = ("optimizer", "scheduler")
_PRECISIONS = ("fp16", "bf16")


def declared_submodules(config: dict):
    """The ``submodules`` declarations of ``config`` (removed from it), or None."""
    options = config.get("deepspeed_multi")
    if not isinstance(options, dict) or SUBMODULES_KEY not in options:
        return None
    declared = options.pop(SUBMODULES_KEY)
    if not isinstance(declared, dict) or not declared:
        raise ValueError(f"deepspeed_multi.submodules must map submodule names to their DeepSpeed settings, e.g. "
                         f"{{\"language_model\": {{\"zero_optimization\": {{\"stage\": 3}}}}}}; got {declared!r}.")
    return declared


class _Rest(nn.Module):
    """Holds the rest's modules and parameters (references: the model keeps them) for its engine.

    Its own forward is never called; the model calls the modules it holds.
    """

    def forward(self, *args, **kwargs):
        raise RuntimeError("deepspeed_multi: the rest of a model with declared submodules is not called as a whole; "
                           "call the model (or the parted engine).")


def _key(name: str) -> str:
    return name.replace(".", "/")  # a module name may not contain "."


class Plan:
    """The parts of one model: ``modules[name]`` and ``configs[name]``, in declaration order, the rest last."""

    def __init__(self, model: nn.Module, config: dict, declared: dict):
        self.model = model
        names = list(declared)
        _check_names(model, names)
        self.configs = declared_configs(config, declared)
        self.modules = {name: model.get_submodule(name) for name in names}
        rest = _rest_container(model, names)
        if rest is not None:
            self.modules[REST] = rest
            self.configs[REST] = copy.deepcopy(config)
        self._check_disjoint()

    def stages(self) -> dict:
        return {name: zero_stage(cfg) for name, cfg in self.configs.items()}

    def owner_of(self) -> dict:
        """id(parameter) -> part name."""
        return {id(p): name for name, m in self.modules.items() for p in m.parameters()}

    def _check_disjoint(self):
        full = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            full.setdefault(id(p), []).append(n)
        seen = {}
        for name, module in self.modules.items():
            for p in module.parameters():
                if id(p) in seen and seen[id(p)] != name:
                    raise ValueError(
                        f"deepspeed_multi.submodules: parameter {' = '.join(full.get(id(p), ['?']))} belongs to two parts, "
                        f"{seen[id(p)]!r} and {name!r} (a weight tied across them). Each part updates its own "
                        "parameters, so a shared one would be updated twice with two partial gradients. Declare "
                        "one submodule that holds both uses, or untie the weight.")
                seen[id(p)] = name
        missing = [n for n, p in self.model.named_parameters() if id(p) not in seen]
        assert not missing, missing  # the rest takes everything the declarations leave


def declared_configs(config: dict, declared: dict) -> dict:
    """Each declared part's config (the model's, with the declaration over it), in declaration order."""
    return {name: _part_config(config, given, name) for name, given in declared.items()}


def _check_names(model, names):
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in model.named_children()]
            raise ValueError(f"deepspeed_multi.submodules: {type(model).__name__} has no submodule {name!r}; its "
                             f"children are {children}. Name a submodule by its dotted path, as in "
                             "model.get_submodule(name).") from None
        if name == "":
            raise ValueError("deepspeed_multi.submodules: the empty name is the whole model; put the whole model's "
                             "settings at the top level of the config instead.")
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"deepspeed_multi.submodules declares both {a!r} and {b!r}, one inside the other: a "
                                 "parameter has one ZeRO configuration. Declare one of them, or split the outer one "
                                 "into its children.")


def _part_config(top: dict, given: dict, name: str) -> dict:
    if not isinstance(given, dict):
        raise ValueError(f"deepspeed_multi.submodules[{name!r}] must be a dict of DeepSpeed settings; got {given!r}.")
    where = f"deepspeed_multi.submodules[{name!r}]"
    for key in _ONE_FOR_ALL:
        if key in given:
            raise ValueError(f"{where} sets {key!r}: one {key} serves every part of the model. Set it at the top "
                             "level of the config (or pass it to initialize).")
    for key in _WHOLE_MODEL:
        if key in given and key in top and given[key] != top[key] and "auto" not in (given[key], top[key]):
            raise ValueError(f"{where} sets {key}={given[key]!r} but the model's config has {key}={top[key]!r}: "
                             "the parts of one model see the same batches and update together (the clip is on the "
                             f"whole model's norm). Drop {key} from the submodule's settings.")
    precisions = [p for p in _PRECISIONS if enabled(given.get(p))]
    if len(precisions) > 1:
        raise ValueError(f"{where} enables both fp16 and bf16; a part runs in one. Enable one of them.")
    base = copy.deepcopy(top)
    for other in set(_PRECISIONS) - set(precisions) if precisions else ():
        base.pop(other, None)  # the part's own precision replaces the model's
    options = given.get("deepspeed_multi", {})
    if SUBMODULES_KEY in options:
        raise ValueError(f"{where} declares submodules of its own; declare every submodule at the top level.")
    return merged(base, given)


def _rest_container(model: nn.Module, names):
    """A _Rest holding what no declaration covers, or None when the declarations cover every parameter."""
    rest = _Rest()
    has_params = False

    def visit(module, prefix):
        nonlocal has_params
        for pname, p in module.named_parameters(recurse=False):
            rest.register_parameter(_key(prefix + pname), p)
            has_params = True
        for cname, child in module.named_children():
            path = prefix + cname
            if path in names:
                continue
            if any(n.startswith(path + ".") for n in names):
                visit(child, path + ".")
            elif any(True for _ in child.parameters()):
                rest.add_module(_key(path), child)
                has_params = True

    visit(model, "")
    return rest if has_params else None
