"""transformers.Trainer on MultiEngines (deepspeed_multi.transformers) against a DDP Trainer on the
same job: logged losses, grad_norm and learning rates and the final weights exact (fp32), at
gradient accumulation 1, 2 and 4, max_grad_norm on and off, the loss normalized by the window's tokens or
divided by the accumulation count, ZeRO 1-3. One process group runs every case of a test."""
import pytest

pytest.importorskip("transformers")

import trainer_checks as checks  # noqa: E402
from harness import run_distributed  # noqa: E402


def test_trainer_matches_ddp_trainer():
    run_distributed(checks.trainer_vs_ddp, [(2, 1, 0.5, True), (2, 2, 0.5, True), (3, 2, 0.5, True),
                                            (1, 2, 0.0, True), (3, 1, 0.0, True), (2, 2, 0.5, False),
                                            (3, 2, 0.0, False), (2, 4, 0.5, True), (3, 4, 0.5, False)],
                    timeout_s=400)


def test_trainer_again_over_the_trained_model():
    """A new Trainer over a model trained by one (its engine destroyed first) matches DDP (ZeRO-2, ZeRO-3);
    evaluate() then train() at ZeRO-3 too."""
    run_distributed(checks.again_vs_ddp, (2, 3), timeout_s=300)


def test_trainer_save_resume_and_from_pretrained():
    """A checkpoint at every step; resume_from_checkpoint inside an epoch and at its end resumes bit-identical
    across the epoch boundary; save_model -> from_pretrained round trip (ZeRO-2, ZeRO-3)."""
    run_distributed(_both, timeout_s=400)


def _both():
    checks.save_resume_and_from_pretrained(2)
    checks.save_resume_and_from_pretrained(3)


def test_trainer_fp16_optimizer_step_was_skipped():
    """fp16, a loss scale that overflows at first: optimizer_step_was_skipped exactly when the engine
    skipped, and the LR schedule advancing on applied updates only (ZeRO-2 gas 1, ZeRO-3 gas 2)."""
    run_distributed(_fp16, timeout_s=300)


def _fp16():
    return checks.fp16_skipped_steps(2, 1), checks.fp16_skipped_steps(3, 2)


@pytest.mark.skipif(not checks.upstream_is_reference(), reason="GPU only: on CPU the check above covers the engine "
                    "alone (DSM_TEST_UPSTREAM_REFERENCE=1 runs this one on CPU too)")
def test_trainer_fp16_skips_like_upstream():
    """fp16 on a GPU: the updates our engine skips, the losses, gradient norms and learning rates are
    upstream DeepSpeed's under the plain Trainer on the same job, bit for bit (ZeRO-2 gas 1, ZeRO-3 gas 2)."""
    run_distributed(_fp16_vs_upstream, timeout_s=300)


def _fp16_vs_upstream():
    return checks.fp16_skips_like_upstream(2, 1), checks.fp16_skips_like_upstream(3, 2)


def test_trl_trainers_with_per_role_configs():
    """TRL's trainers through multi_engine_trainer, each extra model at ZeRO-3 via deepspeed_roles,
    against the same TRL trainer under DDP (losses, grad_norm, LR, final weights exact; the engines'
    stages asserted): SFTTrainer (ZeRO-2, and ZeRO-3 with packing, gas 2), DPOTrainer (policy ZeRO-2, gas
    1 and 2 (sync_ref_model: the next test); a LoRA policy at ZeRO-2
    and ZeRO-3 without a reference model), GRPOTrainer (policy
    ZeRO-2 gas 1 with a reward model, policy ZeRO-3 generating at gas 2), RLOOTrainer (gas 2,
    reference and reward model), DistillationTrainer (teacher, gas 1 and 2), and the experimental
    OnlineDPOTrainer (reference and reward model) and GKDTrainer (teacher)."""
    pytest.importorskip("trl")
    run_distributed(_trl, timeout_s=600)


def _trl():
    checks.sft_vs_ddp()
    checks.dpo_vs_ddp()
    checks.grpo_vs_ddp()
    checks.grpo_vs_ddp([(2, 2, True)], trainer="RLOO")
    checks.distillation_vs_ddp()
    checks.online_dpo_vs_ddp()
    checks.gkd_vs_ddp()


def test_trainer_dpo_sync_ref_model_resume():
    """DPOTrainer(sync_ref_model=True), policy ZeRO-2, reference ZeRO-3 (deepspeed_roles): matches DDP, and
    resume_from_checkpoint past a sync is bit-identical to the uninterrupted run (policy, synced reference,
    every logged value), with the script's reference built from the initial policy or from other weights;
    a checkpoint without the role state (an earlier release) resumes as TRL under DDP does, with a warning."""
    pytest.importorskip("trl")
    run_distributed(checks.dpo_sync_ref_resume, timeout_s=300)
