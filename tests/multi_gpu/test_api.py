"""Everything a DeepSpeed user calls keeps working on MultiEngine; bad input gets a clear error."""
import pytest

import api_checks as checks
from harness import run_distributed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_roundtrip(stage, tmp_path):
    run_distributed(checks.checkpoint_roundtrip, stage, str(tmp_path))


def test_gathered_parameters_and_zero_init():
    run_distributed(checks.gathered_parameters_full_shape)
    run_distributed(checks.zero_init_mixed_stages)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_features(stage):
    """Inference-only engines, engine.backward(loss), no_sync, step inside backward refused."""

    run_distributed(_features, stage)


def _features(stage):
    checks.inference_only_input_grad(stage)
    checks.old_backward_api(stage)
    checks.no_sync_accumulates(stage)
    checks.step_inside_backward_refused(stage)
    checks.recovers_after_failed_backward(stage)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_destroy_hands_the_module_back(stage):
    """deepspeed_multi/hand_back.py: [Note: destroy() hands the module back]."""
    run_distributed(checks.destroy_then_rebuild, stage)


def test_round_robin_fp32_links(tmp_path):
    """deepspeed_multi/zero/stage12/round_robin.py: [Note: round-robin fp32 links]."""
    run_distributed(checks.round_robin_fp32_links, str(tmp_path))


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("shared", [0, 1], ids=["one-rank-only", "both-accumulated"])
def test_ranks_disagree_refused(stage, shared):
    run_distributed(checks.ranks_disagree_refused, stage, 1, shared, timeout_s=60)


def test_bad_config_refused():
    run_distributed(checks.bad_config_refused, world_size=1)


def test_fp16_overflow_skips_only_that_engine():
    run_distributed(checks.fp16_overflow_skips_only_that_engine)


@pytest.mark.parametrize("stages", [(2, 3), (0, 1)])
def test_skip_group_skips_together(stages):
    run_distributed(checks.skip_group_skips_together, *stages)


def test_bucket_buffers_sized_for_the_engine():
    """deepspeed_multi/zero/bucket_size.py: [Note: buckets sized for the engine]; zero/block_sizes.py:
    [Note: sizes from the model's block]; zero/stage3/rank_order.py: [Note: a bucket laid out for the
    reduce-scatter]."""
    run_distributed(_buckets)


@pytest.mark.parametrize("stage, sub_group_size", [(1, 10**9), (2, 10**9), (3, 10**9), (3, 100)])
def test_fp32_master_is_the_parameter_partition(stage, sub_group_size, tmp_path):
    """deepspeed_multi/zero/master_alias.py: [Note: one fp32 partition, not two]."""
    run_distributed(checks.master_aliased, stage, sub_group_size, str(tmp_path))


def _buckets():
    for stage, dtype, overlap in [(1, "fp32", False), (2, "fp32", False), (2, "fp32", True), (2, "bf16", True),
                                  (3, "fp32", False), (3, "bf16", True)]:
        checks.bucket_buffers_sized(stage, dtype, overlap)
    for stage, clip in [(1, 0.0), (2, 0.5), (3, 0.0), (3, 0.5)]:
        checks.block_sizes_bitwise(stage, clip)
    for dtype in ("fp32", "bf16"):
        checks.rank_order_bitwise(dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_zero3_gradient_partitions_live_from_first_gradient_to_update(dtype):
    """deepspeed_multi/zero/stage3/lazy_grads.py: [Note: ZeRO-3's gradient partitions between updates]."""
    run_distributed(checks.lazy_grad_partitions, dtype)


@pytest.mark.parametrize("dtype, persistence", [("bf16", 0), ("fp16", 0), ("bf16", 100)])
def test_zero3_16bit_partition_cast_from_master_at_gather(dtype, persistence, tmp_path):
    """deepspeed_multi/zero/stage3/cast_on_gather.py: [Note: one parameter partition in mixed precision]."""
    run_distributed(checks.cast_on_gather, dtype, str(tmp_path), persistence)


def test_zero3_16bit_partition_cast_from_master_on_a_transformers_model():
    """deepspeed_multi/zero/stage3/cast_on_gather.py on a model built partitioned, with tied embeddings."""
    run_distributed(checks.cast_on_gather_hf)


def test_zero3_16bit_partition_cast_from_master_through_a_universal_checkpoint(tmp_path):
    """deepspeed_multi/zero/stage3/cast_on_gather.py: DeepSpeed's universal-checkpoint load runs on its layout."""
    run_distributed(checks.cast_on_gather_universal, str(tmp_path))
