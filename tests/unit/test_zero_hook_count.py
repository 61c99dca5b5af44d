"""zero_hook_count: the cached used-parameter count equals DeepSpeed's count in every backward.

Graphs are drawn: which of the parameters the loss uses, which are frozen after the count
was built (``requires_grad_(False)``), a parameter used twice, reentrant-style nested
backwards (``torch.autograd.grad`` inside a hook; both counts refuse to run inside
``autograd.grad`` itself, where DeepSpeed's post-accumulate hooks never fire), and several backwards over the same
counter, so accumulators must stay the parameters' own between graphs.
"""
import torch
from deepspeed.runtime.utils import count_used_parameters_in_backward
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_multi.zero.stage12.hook_count import UsedParameterCount


def _counts_in_backward(params, counter, loss):
    seen = []

    def hook(grad):
        seen.append((counter(), count_used_parameters_in_backward(params)))
        return grad

    loss.register_hook(hook)
    loss.backward()
    return seen


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_cached_count_equals_deepspeed_count(n, data):
    layers = [torch.nn.Linear(3, 3) for _ in range(n)]
    params = [p for layer in layers for p in layer.parameters()]
    counter = UsedParameterCount(params)
    for _ in range(3):  # new graphs over the same counter
        used = data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n), label="layers used")
        frozen = data.draw(st.sets(st.integers(0, len(params) - 1), max_size=len(params)), label="frozen")
        for i, p in enumerate(params):
            p.requires_grad_(i not in frozen)
        x = torch.randn(2, 3, requires_grad=True)
        h = x
        for i in used:  # a layer listed twice is used twice
            h = layers[i](h)
        loss = h.sum() * 1.0
        for want_got in _counts_in_backward(params, counter, loss):
            got, want = want_got
            assert got == want, (used, frozen, got, want)


def test_nested_backward_counts_its_own_graph():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    params = list(a.parameters()) + list(b.parameters())
    counter = UsedParameterCount(params)

    def hook(grad):
        with torch.enable_grad():
            y = b(torch.randn(1, 2)).sum()
            torch.autograd.grad(y, list(b.parameters()))  # a nested graph task that reaches only b
        return grad

    out = a(torch.randn(1, 2)).sum()
    out.register_hook(hook)
    seen = _counts_in_backward(params, counter, out)
    assert seen == [(2, 2)]

