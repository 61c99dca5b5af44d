"""The Hugging Face examples (examples/hf/) in their short mode, on 2 CPU processes, through both
launchers: each must finish and show its loss falling (the example exits non-zero otherwise)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]
TIMEOUT_S = 300


def _run(cmd, tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def _launch_config(tmp_path, stage):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                                "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
                                "zero_optimization": {"stage": stage}}))
    return str(path)


@pytest.mark.parametrize("example,launcher,extra,expect", [
    ("distillation.py", "torchrun", [], "student ZeRO-2 (trained), teacher ZeRO-3 (frozen); world size 2"),
    ("ppo.py", "accelerate", [], "actor ZeRO-2, critic ZeRO-3 (trained); reference ZeRO-3, reward ZeRO-3 (frozen)"),
    ("encoder_llm.py", "torchrun", ["--freeze-llm"], "LLM ZeRO-3 (frozen); world size 2"),
    ("dpo.py", "accelerate-config-file", [], "policy ZeRO-1 (trained), reference ZeRO-3 (frozen); world size 2"),
])
def test_example_short(example, launcher, extra, expect, tmp_path):
    script = os.path.join("examples", "hf", example)
    if launcher == "torchrun":
        cmd = TORCHRUN + [script]
    elif launcher == "accelerate":
        cmd = ACCELERATE + ["--multi_gpu", script]
    else:   # the launch-time DeepSpeed config file becomes the trained model's config
        cmd = ACCELERATE + ["--use_deepspeed", "--deepspeed_config_file", _launch_config(tmp_path, 1), script]
    out = _run(cmd + ["--short"] + extra, tmp_path)
    assert expect in out, f"expected {expect!r} in the output:\n{out[-3000:]}"
    assert "first" in out and "->" in out, out[-3000:]


@pytest.mark.parametrize("example,expect,trend", [
    ("trainer.py", "model LlamaForCausalLM ZeRO-3 (trained); world size 2", "Trainer loss: first"),
    ("dpo.py", "model LlamaForCausalLM ZeRO-2 (trained); ref_model LlamaForCausalLM ZeRO-3 (frozen); world size 2",
     "DPO loss: first"),
    ("grpo.py", "model LlamaForCausalLM ZeRO-2 (trained); ref_model LlamaForCausalLM ZeRO-3 (frozen); "
                "reward_funcs LlamaForSequenceClassification ZeRO-3 (frozen); world size 2",
     "GRPO rewards/counts_on/mean: first"),
])
def test_trainer_example_short(example, expect, trend, tmp_path):
    """examples/trl/: the Trainer, DPOTrainer and GRPOTrainer examples in short mode (each exits
    non-zero unless its loss fell, or for GRPO its rule reward rose)."""
    if example != "trainer.py":
        pytest.importorskip("trl")
    out = _run(TORCHRUN + [os.path.join("examples", "trl", example), "--short", "--out", str(tmp_path)], tmp_path)
    assert expect in out, f"expected {expect!r} in the output:\n{out[-3000:]}"
    assert trend in out, out[-3000:]
