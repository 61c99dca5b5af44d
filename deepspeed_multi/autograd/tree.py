"""Find and replace the tensors inside any output structure an engine may return.

Handles tensors, tuples (named tuples too), lists, dicts (``OrderedDict`` and Hugging Face
``ModelOutput``), and dataclasses, nested to any depth. Anything else is left untouched.
"""
import dataclasses
from typing import Any, Callable, List

import torch


def _is_model_output(obj) -> bool:
    # Hugging Face ModelOutput: an OrderedDict that is also a dataclass and keeps its
    # attributes in sync with its items on __setitem__. Detected without importing transformers.
    return isinstance(obj, dict) and dataclasses.is_dataclass(obj) and hasattr(obj, "to_tuple")


def tree_tensors(obj: Any) -> List[torch.Tensor]:
    found: List[torch.Tensor] = []
    tree_map(lambda t: found.append(t) or t, obj)
    return found


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Return ``obj`` with every tensor ``t`` replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _is_model_output(obj):
        for key in list(obj.keys()):
            obj[key] = tree_map(fn, obj[key])
        return obj
    if isinstance(obj, tuple):
        items = [tree_map(fn, item) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return type(obj)(tree_map(fn, item) for item in obj)
    if isinstance(obj, dict):
        items = [(key, tree_map(fn, value)) for key, value in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:
            return dict(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: tree_map(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj
