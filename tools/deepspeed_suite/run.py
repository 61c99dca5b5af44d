"""Run a selection of DeepSpeed's own unit tests upstream and with deepspeed_multi.initialize.

    python tools/deepspeed_suite/run.py --deepspeed-src <DeepSpeed checkout> [--side both|upstream|ours]

DeepSpeed's tests are the widest catalogue of code written against ``deepspeed.initialize``; this
runs them from the given checkout (nothing of them lives in this repository) twice: once as they
are ("upstream") and once with ``deepspeed.initialize`` replaced by ``deepspeed_multi.initialize``
in every test process ("ours", through tools/drop_in/sitecustomize.py). It prints each test's
outcome on both sides, the counts, the engine classes each side built (read from a log every
engine-building process appends to), and the tests that pass upstream but not with ours.

DeepSpeed's CPU accelerator counts NUMA nodes as devices, so LOCAL_SIZE=4 lets its multi-rank tests
run on CPU; DeepSpeed pins pytest < 8.4 and runs its tests with pytest-forked (``make
test-deepspeed-suite`` installs both into a folder of their own, passed as --pytest-packages).
Exit status: 1 when a test passes upstream and not with ours, or an engine built on ours is not deepspeed_multi's.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DROP_IN = os.path.join(REPO, "tools", "drop_in")
sys.path.insert(0, DROP_IN)
from sitecustomize import read_log  # noqa: E402  (the swap hook, read back)

# Under <src>/tests: the ZeRO, half-precision, checkpoint and engine-API tests that run on CPU, by
# class where a file's full parametrization would take hours on a small CPU box (test_zero.py and
# test_zero_user_backward.py alone collect 290 tests). --all runs ALL_FILES instead.
SELECTION = [
    *(f"unit/v1/zero/test_zero.py::{c}" for c in (
        "TestZero3ParamPartitioningBase", "TestBF16OptimizerGradReduction", "TestZeroUnbalancedGradients",
        "TestZeroFrozenWeights", "TestZeroAdamOptimizerStepCount", "TestZero3DictFwd", "TestZeroToFP32",
        "TestGradientAllreduceOpTraining", "TestZeroOffloadOptim", "TestZero3RepeatForwardLoop",
        "TestZeroPartitionCache", "TestZero3SwitchModes")),
    *(f"unit/v1/zero/test_zero_user_backward.py::{c}" for c in (
        "TestUnmanagedGradientAccumulation", "TestZeroUserBackwardBasic", "TestZeroUserBackwardMultipleEngines")),
    "unit/runtime/zero/test_zero_grad_clip.py",
    *(f"unit/runtime/test_ds_initialize.py::{c}" for c in (
        "TestNoOptim", "TestConfigOptimizer", "TestClientOptimizer", "TestZeroGradClip")),
    "unit/runtime/test_multi_output_model.py",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint",
]
ALL_FILES = [
    "unit/v1/zero/test_zero.py",
    "unit/v1/zero/test_zero_user_backward.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_context_ancestry.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/test_multi_output_model.py",
    "unit/runtime/half_precision/test_zero_optim_overflow.py",
    "unit/runtime/half_precision/test_dynamic_loss_scale.py",
    "unit/v1/half_precision/",
    "unit/checkpoint/test_zero_optimizer.py",
]


def run_side(side, args, out):
    log = os.path.join(out, f"engines-{side}.log")
    xml = os.path.join(out, f"{side}.xml")
    for path in (log, xml):
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(args.local_size), DSM_DROP_IN_SIDE=side, DSM_DROP_IN_LOG=log)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [DROP_IN, HERE, args.pytest_packages, REPO, env.get("PYTHONPATH")] if p)
    tests_dir = os.path.join(args.deepspeed_src, "tests")
    env["DSM_SUITE_SELECT"] = "\n".join(args.tests)
    files = list(dict.fromkeys(t.split("::")[0] for t in args.tests))
    cmd = [sys.executable, "-m", "pytest", "--forked", "-n", str(args.workers), "-p", "no:cacheprovider",
           "-p", "suite_select", f"--junitxml={xml}", "-q", "--durations=0", *args.pytest_args, *files]
    print(f"== {side}: {' '.join(cmd)}  (cwd {tests_dir})", flush=True)
    start = time.time()
    with open(os.path.join(out, f"{side}.out"), "w") as f:
        rc = subprocess.call(cmd, cwd=tests_dir, env=env, stdout=f, stderr=subprocess.STDOUT)
    print(f"== {side}: pytest exit {rc} after {time.time() - start:.0f}s (output in {out}/{side}.out)", flush=True)


def outcomes(xml):
    """junit xml -> {test id: passed|failed|error|skipped}; without it (a run cut short), pytest's
    verbose lines in the side's .out."""
    result = {}
    if not os.path.exists(xml):
        text = xml[:-len(".xml")] + ".out"
        if os.path.exists(text):
            with open(text) as f:
                for found in re.finditer(r"\b(PASSED|FAILED|SKIPPED|ERROR) (unit/\S+)", re.sub(r"\x1b\[[0-9;]*m", "", f.read())):
                    result[found.group(2)] = "error" if found.group(1) == "ERROR" else found.group(1).lower()
        return result
    for case in ET.parse(xml).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        if not cls[:1].isupper():  # a module-level test: classname is the module itself
            module, cls = case.get("classname", ""), ""
        test = module.replace(".", "/") + ".py" + (f"::{cls}" if cls else "") + "::" + case.get("name")
        kinds = {child.tag for child in case}
        result[test] = ("failed" if "failure" in kinds else "error" if "error" in kinds else
                        "skipped" if "skipped" in kinds else "passed")
    return result


def report(out):
    up, ours = outcomes(os.path.join(out, "upstream.xml")), outcomes(os.path.join(out, "ours.xml"))
    tests = sorted(set(up) | set(ours))
    width = max((len(t) for t in tests), default=10)
    print(f"\n{'test'.ljust(width)}  upstream  ours")
    for t in tests:
        a, b = up.get(t, "-"), ours.get(t, "-")
        print(f"{t.ljust(width)}  {a.ljust(8)}  {b}{'   <- differs' if a != b else ''}")
    ok = True
    for side, res in (("upstream", up), ("ours", ours)):
        counts = collections.Counter(res.values())
        log = read_log(os.path.join(out, f"engines-{side}.log"))
        built = log["engines"]
        print(f"\n{side}: {len(res)} tests: {counts['passed']} passed, {counts['failed'] + counts['error']} failed "
              f"({counts['error']} errors), {counts['skipped']} skipped; engines built: "
              + (", ".join(f"{n} {c}" for c, n in built.most_common()) or "none"))
        if side == "ours":
            # A MultiEngine, or an engine on DeepSpeed's managed path (reliability/managed_path.py): ours both.
            others = {c: n for c, n in built.items() if not c.startswith("deepspeed_multi.")}
            if others or not built or log["missed"]:
                ok = False
                print(f"ours: engines that are not deepspeed_multi's: {others or 'no engine was built'}; processes "
                      f"that imported deepspeed without the swap: {len(log['missed'])}")
    lost = [t for t in tests if up.get(t) == "passed" and ours.get(t) != "passed"]
    gained = [t for t in tests if up.get(t) != "passed" and ours.get(t) == "passed"]
    print(f"\npass upstream, not with ours: {len(lost)}")
    for t in lost:
        print(f"  {t}: {ours.get(t, 'not run')}")
    print(f"pass with ours, not upstream: {len(gained)}")
    for t in gained:
        print(f"  {t}: upstream {up.get(t, 'not run')}")
    return ok and not lost


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed-src", default=os.environ.get("DEEPSPEED_SRC"), help="a DeepSpeed source checkout")
    p.add_argument("--side", choices=["both", "upstream", "ours", "report"], default="both",
                   help="run one side only (the report reads both sides' last results from --out)")
    p.add_argument("--out", default=os.path.join(REPO, ".deepspeed_suite"), help="results folder")
    p.add_argument("--pytest-packages", default=os.environ.get("DSM_SUITE_PACKAGES"),
                   help="folder with pytest<8.4, pytest-forked, pytest-xdist (prepended on PYTHONPATH)")
    p.add_argument("-n", "--workers", type=int, default=2)
    p.add_argument("--local-size", type=int, default=4)
    p.add_argument("--pytest-arg", dest="pytest_args", action="append", default=[],
                   help="extra pytest argument (repeatable), e.g. --pytest-arg=-k --pytest-arg=Unbalanced")
    p.add_argument("--all", action="store_true", help="run ALL_FILES (several hours on 2 cores)")
    p.add_argument("tests", nargs="*", help="paths or node ids under <src>/tests (default: SELECTION)")
    args = p.parse_args()
    args.tests = args.tests or (ALL_FILES if args.all else SELECTION)
    os.makedirs(args.out, exist_ok=True)
    if args.side != "report":
        if not args.deepspeed_src or not os.path.isdir(os.path.join(args.deepspeed_src, "tests", "unit")):
            p.error("--deepspeed-src (or DEEPSPEED_SRC) must be a DeepSpeed checkout with tests/unit")
        for side in (["upstream", "ours"] if args.side == "both" else [args.side]):
            run_side(side, args, args.out)
    sys.exit(0 if report(args.out) else 1)


if __name__ == "__main__":
    main()
