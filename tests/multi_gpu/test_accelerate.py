"""deepspeed_multi.accelerate.Accelerator: the loops of issue 8 against plain PyTorch (exact, fp32,
LR after every step checked), and the Accelerate/Transformers API around them.

Each test is one multi-process run holding several checks (process start-up is the costly part).
Plain accelerate.Accelerator on the same loops is recorded by ``python tests/multi_gpu/report_accelerate.py``
(docs/accelerate_loops.md), not here.
"""
import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import accelerate_checks as checks  # noqa: E402
import accelerate_features as features  # noqa: E402
from harness import run_distributed  # noqa: E402


def test_distillation_gan_checkpointing():
    """Seed 002's distillation (ZeRO-2 student, frozen ZeRO-3 teacher loaded after select_deepspeed_plugin),
    a GAN alternation (D's gradients from G's loss dropped), a ZeRO-3 LLM with gradient checkpointing."""
    run_distributed(checks.loops_distill_gan)


def test_encoder_llm():
    """Seed 001: ViT encoder (ZeRO-2) -> projector (ZeRO-1) -> Llama fed inputs_embeds (ZeRO-3) under one
    accelerator.backward; gas 1, gas 2 in every config, gas 2/1/2 per model, and the LLM frozen."""
    run_distributed(checks.loops_encoder_llm)


def test_rfc_ppo_four_models():
    """Seed 000's loop on 4 ranks: actor ZeRO-2 and critic ZeRO-3 trained (optimizer + scheduler each),
    reference and reward ZeRO-3 frozen, each prepared with prepare(..., deepspeed_plugin=<config>);
    generate() on the actor, two PPO epochs of backward/step/scheduler/zero_grad per model."""
    run_distributed(checks.loop_rfc, world_size=4, timeout_s=300)


def test_accelerator_api(tmp_path):
    """save_state/load_state, get_state_dict, clip_grad_norm_, accumulate, a launch-time DeepSpeed config
    file with per-call configs beside it, mixed precision per plugin, a DataLoader sharded over the real
    world size, an fp16 overflow that holds the schedule, bad input; zero_init with
    Transformers (stage 3 partitions, stage 2 right after does not, also through the Accelerator);
    ModelOutput/labels= and generate() on a ZeRO-3 engine."""
    run_distributed(features.features, str(tmp_path))
