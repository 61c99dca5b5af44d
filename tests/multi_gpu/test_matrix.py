"""The correctness matrix: every scenario of scenarios.py against plain PyTorch, in real processes.

fp32 scenarios must match to 1e-5; bf16/fp16 ones by cosine (> 0.99) and norm (+-5%) of the
update. Scenarios that cannot work must raise the clear error listed in EXPECTED_ERRORS.
"""
import pytest

import scenarios
from harness import run_distributed

GROUPS = scenarios.groups()
pytestmark = pytest.mark.matrix


@pytest.mark.parametrize("group", [pytest.param(g, marks=[pytest.mark.core] if g in scenarios.CORE else [])
                                   for g in sorted(GROUPS)])
def test_matrix(group):
    names = GROUPS[group]
    world_size = scenarios.SCENARIOS[names[0]]().world_size
    run_distributed(scenarios.check_many, names, world_size=world_size, timeout_s=90 + 20 * len(names))
