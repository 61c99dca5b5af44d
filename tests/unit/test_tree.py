"""tree_map / tree_tensors over every output structure an engine may return."""
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch

from deepspeed_multi.autograd.tree import tree_map, tree_tensors

NT = namedtuple("NT", ["a", "b"])


@dataclass
class DC:
    a: torch.Tensor
    b: object = None


class FakeModelOutput(OrderedDict):
    """Mimics transformers.ModelOutput: an OrderedDict dataclass whose items mirror attributes."""

    def to_tuple(self):
        return tuple(self.values())

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


FakeModelOutput = dataclass(FakeModelOutput)


def test_tree_map_replaces_every_tensor_and_keeps_types():
    t1, t2, t3 = torch.ones(1), torch.ones(2), torch.ones(3)
    tree = {"x": [t1, (t2, 5)], "nt": NT(t3, "s"), "dc": DC(t1, b=[t2]), "none": None}
    out = tree_map(lambda t: t * 2, tree)
    assert isinstance(out["nt"], NT) and isinstance(out["dc"], DC) and isinstance(out["x"][1], tuple)
    assert out["x"][1][1] == 5 and out["nt"].b == "s" and out["none"] is None
    assert torch.equal(out["dc"].b[0], t2 * 2) and torch.equal(out["x"][0], t1 * 2)
    assert len(tree_tensors(tree)) == 5


def test_model_output_is_updated_in_place():
    mo = FakeModelOutput()
    mo["logits"] = torch.ones(2)
    out = tree_map(lambda t: t + 1, mo)
    assert out is mo and torch.equal(mo.logits, torch.full((2, ), 2.0))


def test_non_tensor_leaves_are_untouched():
    assert tree_map(lambda t: t, ("a", 1, 2.0)) == ("a", 1, 2.0)
    assert tree_tensors({"a": "b"}) == []
