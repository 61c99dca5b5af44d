"""One client optimizer (and one LR scheduler) for every part of a model.

[Note: the client optimizer is the parts' hyperparameter source]
A user builds one optimizer over the whole model, with their param groups (no-decay groups,
per-layer learning rates), and one scheduler on it. Each ZeRO part needs its own optimizer over
its own parameters, so each part gets one of the same class with the same groups restricted to
its parameters (a group with none of them is left out). The client optimizer itself is never
stepped and holds no state: it stays the one place where hyperparameters live. Before every
update each part's groups take the current values (``lr``, ``weight_decay``, ``betas``...) of
the client group they came from, so a scheduler stepping the client optimizer (the parted
engine steps it once per applied update, as DeepSpeed steps its own) drives every part, and so
does a user who sets ``optimizer.param_groups[i]["lr"]`` by hand.
"""
import torch


def split(client: torch.optim.Optimizer, owner_of: dict, parts):
    """Per part: (an optimizer of ``client``'s class over its parameters, [client group index per group])."""
    if client.state:
        raise ValueError("deepspeed_multi: the optimizer passed to initialize with declared submodules has state "
                         "already (it has stepped). Pass a freshly built optimizer; its state cannot be split "
                         "between the parts' ZeRO optimizers.")
    known = set(owner_of)
    for i, group in enumerate(client.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(f"deepspeed_multi: param group {i} of the optimizer holds a parameter (shape "
                                 f"{tuple(p.shape)}) that is not a parameter of the model. Build the optimizer "
                                 "over model.parameters() (or groups of them).")
    out = {}
    for part in parts:
        groups, sources = [], []
        for i, group in enumerate(client.param_groups):
            params = [p for p in group["params"] if owner_of[id(p)] == part]
            if params:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
                sources.append(i)
        out[part] = (_build(client, groups) if groups else None, sources)
    return out


def _build(client, groups):
    cls = type(client)
    try:
        return cls(groups, **client.defaults)
    except TypeError:
        try:
            return cls(groups)  # every hyperparameter is in the groups
        except TypeError as error:
            raise TypeError(f"deepspeed_multi: cannot build a {cls.__name__} per part of the model from the "
                            f"optimizer's param groups ({error}). Give the optimizer in the config's \"optimizer\" "
                            "section instead, or use an optimizer whose constructor takes (param_groups, "
                            "**defaults).") from error
    # (the parts' optimizers are wrapped by DeepSpeed; nothing else holds them)


def sync_hyperparameters(client, part_optimizer, sources) -> None:
    """Copy the client groups' current hyperparameters onto the part's groups they came from."""
    for group, i in zip(part_optimizer.param_groups, sources):
        for key, value in client.param_groups[i].items():
            if key != "params":
                group[key] = value
