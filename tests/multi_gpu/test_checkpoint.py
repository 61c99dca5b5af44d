"""One checkpoint for a set of engines (deepspeed_multi/checkpoint.py): resume is bit-identical
in fp32 at ZeRO 0-3 and mixed stages with Adam, in fp16 after overflow-skipped steps, and a job
SIGKILLed anywhere inside a save resumes from a complete checkpoint, bit-identical to the
uninterrupted run."""
import os
import signal

import checkpoint_checks as checks
import frozen_state_checks
from rank_launcher import run_ranks_to_exit
from harness import run_distributed


def test_resume_is_bit_identical(tmp_path):
    sets = sorted(checks.SETS)
    run_distributed(checks.save_then_continue, str(tmp_path), sets)
    run_distributed(_resume_then_window, str(tmp_path), sets)


def test_fp16_resume_after_overflow_is_bit_identical(tmp_path):
    """fp16 with dynamic loss scaling at ZeRO 0-3, saved after overflow-skipped steps lowered the
    loss scale: the resumed run ends bit-identical (fp32 master weights, loss scale, the scaler's
    hysteresis and overflow iteration, skipped-step count) through another overflow and a scale increase."""
    sets = sorted(checks.FP16_SETS)
    run_distributed(checks.save_then_continue, str(tmp_path), sets)
    run_distributed(checks.resume_and_compare, str(tmp_path), sets)


def test_frozen_engines_that_change_resume(tmp_path):
    """Engines without an optimizer whose state changes (an EMA teacher and a synced reference at
    ZeRO-0 and 3, a frozen prior with BatchNorm in train and eval mode at ZeRO-0 and 3) resume
    bit-identical into engines all built from other weights, and the uninterrupted run equals DDP's
    (1e-5, buffers rank by rank); an unchanged frozen engine writes nothing at a save."""
    run_distributed(frozen_state_checks.resume_cases, str(tmp_path), sorted(frozen_state_checks.CASES))
    run_distributed(frozen_state_checks.disk_cost, str(tmp_path))


def test_resume_at_another_world_size(tmp_path):
    """A set with engines at ZeRO 0, 1, 2 and 3 (one inference-only, gas 1 and 2) saved on 2 ranks
    resumes on 4, and saved on 4 resumes on 2, equal (fp32, 1e-5) to the uninterrupted run on the
    same global batch."""
    root = str(tmp_path)
    run_distributed(checks.save_for_resize, root, world_size=2)
    run_distributed(_resume_and_save_for_resize, root, world_size=4)
    run_distributed(checks.resume_resized, root, 4, world_size=2)


def _resume_and_save_for_resize(root):
    checks.resume_resized(root, 2)
    checks.save_for_resize(root)


def _resume_then_window(root, sets):
    checks.resume_and_compare(root, sets)
    checks.save_refused_mid_window(root)


def _logs(ranks):
    def clean(log):
        return "\n".join(line for line in log.splitlines() if "Warning" not in line and "return func" not in line)
    return "\n".join(f"----- rank {r} (exit {x['exitcode']}) -----\n{clean(x['log'])[-4000:]}" for r, x in enumerate(ranks))


# kill point -> whether the save it interrupts is complete (published by the rename)
KILLS = {"before": False, "between_engines": False, "after_engines": False, "before_rename": False,
         "before_latest": True}


def test_kill_during_save(tmp_path):
    root = str(tmp_path / "ckpt")
    expected, incomplete = None, []
    for i, (point, published) in enumerate(KILLS.items()):
        tag = f"k{i}-{point}"
        ranks = run_ranks_to_exit(checks.kill_round, root, expected, point, tag, world_size=2, timeout_s=240)
        logs = _logs(ranks)
        assert ranks[0]["exitcode"] == -signal.SIGKILL, f"rank 0 must die by SIGKILL at {point!r}:\n{logs}"
        assert all(x["exitcode"] not in (None, 0) for x in ranks), logs
        assert f"SAVING {tag}" in ranks[0]["log"], logs
        if expected is not None:
            assert f"RESUMED {expected} " in ranks[0]["log"], logs
        if expected is None:
            expected = "first"
        if published:
            expected = tag
        elif point != "before":
            incomplete.append(f".{tag}.staging")
        assert not os.path.exists(os.path.join(root, tag)) or published, f"{point}: tag published too early"
    run_distributed(checks.last_round, root, expected, incomplete)
