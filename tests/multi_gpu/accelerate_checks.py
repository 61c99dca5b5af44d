"""Rank functions for test_accelerate.py."""
import hf_loops
from hf_common import run_loops


def loops_distill_gan():
    return run_loops([hf_loops.distillation(), hf_loops.distillation_config_optimizer(), hf_loops.gan(),
                      hf_loops.llm_gradient_checkpointing()])


def loops_encoder_llm():
    return run_loops([hf_loops.encoder_llm(1), hf_loops.encoder_llm(2), hf_loops.encoder_llm((2, 1, 2)),
                      hf_loops.encoder_llm(1, llm_trained=False)])


def loop_rfc():
    return run_loops([hf_loops.rfc_ppo()])

