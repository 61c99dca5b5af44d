"""The Lightning examples (examples/lightning/) in their short mode on 2 CPU processes under torchrun:
each must finish and show its loss falling (the example exits non-zero otherwise). Plain
Lightning DeepSpeed on the same programs is recorded in docs/lightning.md, not here."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
TIMEOUT_S = 300


@pytest.mark.parametrize("example,expect,trend", [
    ("fabric_gan.py", "Generator ZeRO-2; Discriminator ZeRO-1; world size 2", "fake-vs-real gap: first"),
    ("fabric_distillation.py", "Teacher ZeRO-3 (frozen); Student ZeRO-2 (trained); world size 2",
     "distillation loss: first"),
    ("trainer_gan.py", "generator ZeRO-2; discriminator ZeRO-1; world size 2", "fake-vs-real gap: first"),
])
def test_lightning_example_short(example, expect, trend):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = TORCHRUN + [os.path.join("examples", "lightning", example), "--short"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    assert expect in out and trend in out, f"expected {expect!r} and {trend!r} in the output:\n{out[-3000:]}"
