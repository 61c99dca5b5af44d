"""Drop-in: configs and programs written for ``deepspeed.initialize`` build and train through ours with
upstream's bits (drop_in_checks.py), in one group of ranks per world size."""
import drop_in_checks as checks
from harness import run_distributed


def test_overlap_comm_below_stage2_as_upstream():
    run_distributed(checks.overlap_below_stage2, timeout_s=300)


def test_zero1_overlap_comm_as_upstream_on_four_ranks():
    """Over four ranks an all-reduce's rounding depends on where each element lies in its bucket, so only
    upstream's bucket order (the backward's) gives its bits."""
    run_distributed(checks.overlap_below_stage2, (1, ), ("fp32", "bf16"), (2, ), world_size=4, timeout_s=300)


def test_writes_that_gathered_parameters_discards_are_warned():
    run_distributed(checks.gathered_writes_warned, timeout_s=300)
