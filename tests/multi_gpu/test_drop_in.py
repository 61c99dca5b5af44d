"""Drop-in: configs and programs written for ``deepspeed.initialize`` build and train through ours with
upstream's bits (drop_in_checks.py), in one group of ranks per world size."""
import drop_in_checks as checks
from harness import run_distributed


def test_overlap_comm_below_stage2_as_upstream():
    run_distributed(checks.overlap_below_stage2, timeout_s=300)
    run_distributed(checks.fp16_zero0_norm_as_upstream, timeout_s=120)


def test_zero1_overlap_comm_as_upstream_on_four_ranks():
    """Over four ranks an all-reduce's rounding depends on where each element lies in its bucket, so only
    upstream's bucket order (the backward's) gives its bits."""
    run_distributed(checks.overlap_below_stage2, (1, ), ("fp32", "bf16"), (2, ), world_size=4, timeout_s=300)


def test_engine_backward_as_upstream():
    """engine.backward with every argument upstream's takes, bit-identical to upstream at ZeRO 0-3 (a parameter
    used directly outside the forward too); through a second engine as a plain loss.backward()."""
    run_distributed(checks.engine_backward_as_upstream, timeout_s=300)
    run_distributed(checks.engine_backward_through_two_engines, timeout_s=120)


def test_rng_as_upstream():
    run_distributed(checks.rng_as_upstream, timeout_s=120)


def test_zero_dim_parameters_build_and_train():
    run_distributed(checks.zero_dim_parameters, timeout_s=240)


def test_initialize_swapped_for_ours_does_not_reenter():
    """deepspeed.initialize bound to ours (a program's own swap, the drop-in hook): ours, upstream's name and our
    Accelerator's prepare each build a MultiEngine, none re-entering itself."""
    run_distributed(checks.initialize_swapped_for_ours, timeout_s=120)


def test_writes_that_gathered_parameters_discards_are_warned():
    run_distributed(checks.gathered_writes_warned, timeout_s=300)


def test_boundary_owning_features_build_and_train_as_upstream():
    """ZenFlow, DeepCompile (without engine.compile(), as upstream runs it on CPU), the hybrid engine, pipeline
    engines: built where upstream builds them, bit-identical trained alone, refused by name only at a backward
    that reaches them beside another engine (or a plain loss.backward() where upstream needs engine.backward)."""
    run_distributed(checks.managed_features_as_upstream, timeout_s=400)
    run_distributed(checks.superoffload_fails_as_upstream, timeout_s=120)
    # Fresh ranks: a pipeline engine leaves DeepSpeed's process-wide groups (its mpu) behind, upstream too.
    run_distributed(checks.pipeline_as_upstream, timeout_s=120, fresh=True)


def test_accelerate_drives_a_boundary_owning_engine_as_upstream():
    run_distributed(checks.accelerate_managed_as_upstream, timeout_s=300)


def test_hpz_group_stays_with_the_engine_that_configures_it():
    # Fresh ranks: the hpZ group DeepSpeed creates stays in the process (what the check is about).
    run_distributed(checks.hpz_group_stays_with_its_engine, timeout_s=180, fresh=True)
