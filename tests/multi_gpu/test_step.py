"""step() as PyTorch's optimizer.step(): nothing accumulated means no update (the schedule still
advances), and an exception inside DeepSpeed's step() leaves an engine that trains exactly."""
import pytest

import step_checks as checks
from harness import run_distributed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_without_backward_and_failed_step(stage):
    run_distributed(_all, stage)


def _all(stage):
    checks.step_without_backward(stage, gas=1)
    checks.step_without_backward(stage, gas=2)
    checks.step_exception_recovers(stage)
