"""What a frozen engine costs a set checkpoint: time and new bytes per save, unchanged and changed.

A trained student (ZeRO-2, AdamW) beside a frozen teacher without an optimizer, at ZeRO-3 and at
ZeRO-0. Per save, on 2 ranks, the median of ``--repeat`` saves of each kind, all in one save
directory as a training run's saves are:

* baseline: the student alone (what a save cost before frozen engines were saved);
* unchanged: student + teacher, the teacher as at the previous save (content-addressed: its object
  is there already, so the save hashes it and writes nothing for it);
* changed: student + teacher after an in-place EMA step of the teacher (a new object per distinct
  rank state: at ZeRO-3 one partition per rank, below it one full copy).

New bytes are what the save added under the save directory (the tag and new frozen-state objects).
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _bench  # noqa: E402


def _du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _run(root, stage, width, layers, repeat):
    import deepspeed.comm as dist
    from common import scale_in_place  # tests/multi_gpu, on the path through _bench

    import deepspeed_multi
    student = _bench.build_engine(deepspeed_multi.initialize, _bench.Tower(64, 128, 2, 64, seed=1), _bench.ds_config(2))
    teacher = _bench.build_engine(deepspeed_multi.initialize, _bench.Tower(64, width, layers, 64, seed=2),
                                  _bench.ds_config(stage), trainable=False)
    save_dir = os.path.join(root, f"z{stage}")

    def save(engines, tag):
        dist.barrier()
        before = _du(save_dir) if dist.get_rank() == 0 else 0
        start = time.perf_counter()
        deepspeed_multi.save_checkpoint(save_dir, engines, tag=tag)
        took = time.perf_counter() - start
        seconds = [None] * dist.get_world_size()
        dist.all_gather_object(seconds, took)
        return max(seconds), (_du(save_dir) - before if dist.get_rank() == 0 else 0)

    def ema():
        scale_in_place(teacher.module, 0.99)

    out = {"baseline": [], "unchanged": [], "changed": []}
    save({"student": student, "teacher": teacher}, "first")  # the teacher's first object
    for i in range(repeat):
        out["baseline"].append(save({"student": student}, f"b{i}"))
        out["unchanged"].append(save({"student": student, "teacher": teacher}, f"u{i}"))
        ema()
        out["changed"].append(save({"student": student, "teacher": teacher}, f"c{i}"))
    return {"teacher_params": _bench.n_params(teacher.module), "student_params": _bench.n_params(student.module),
            **{k: (statistics.median(s for s, _ in v), statistics.median(b for _, b in v)) for k, v in out.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    root = tempfile.mkdtemp(prefix="dsm_frozen_save_")
    try:
        for stage in (3, 0):
            r = _bench.launch(_run, root, stage, args.width, args.layers, args.repeat)[0]
            base_s, base_b = r["baseline"]
            for kind in ("baseline", "unchanged", "changed"):
                s, b = r[kind]
                rows.append([f"ZeRO-{stage}", kind, f"{s * 1e3:.0f}", f"{(s - base_s) * 1e3:+.0f}", f"{b / 2**20:.1f}",
                             f"{(b - base_b) / 2**20:+.1f}"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"frozen teacher: {r['teacher_params'] / 1e6:.1f}M parameters (fp32, {r['teacher_params'] * 4 / 2**20:.0f} "
          f"MiB), student {r['student_params'] / 1e6:.2f}M; {_bench.WORLD_SIZE} ranks; {_bench.cpu_model()}; median "
          f"of {args.repeat} saves each")
    print(_bench.fmt_table(["teacher", "save", "ms", "vs baseline", "new MiB", "vs baseline"], rows))


if __name__ == "__main__":
    main()
