"""Peer programs, upstream vs deepspeed_multi: ``make test-peer-programs`` (docs/tests.md).

    python tools/peer_programs/run.py --out <results dir> [--dschat-src <DeepSpeed-Chat dir>]
        [--openrlhf-packages <folder with openrlhf==0.11.0>] [--trl-src <a TRL checkout>]
        [--only dschat|openrlhf|trl] [--quick]

Runs each harness beside this file as a program of its own and fails when either does:

* DeepSpeed-Chat step 3 (deepspeed_chat/run.py): its default selection (every actor/critic ZeRO
  stage pair 0-3 at EMA on, gas 2; EMA off, gas 1 and optimizer offload at five pairs), the
  one-backward variant at four pairs, upstream run twice at one pair, and the hybrid engine at one
  pair (both sides fail on CPU: DeepSpeed's hybrid engine has no CPU op).
* OpenRLHF's train_sft, train_rm and train_dpo at ZeRO 1-3 in bf16 (openrlhf/run.py), upstream
  run twice at one case and the one-backward DPO variant at every stage.
* TRL's scripts under ``accelerate launch`` with TRL's shipped DeepSpeed yaml (trl/run.py): sft, dpo,
  kto, reward, grpo, rloo and distillation of the installed TRL, and gkd and online_dpo of a TRL
  checkout (--trl-src), at ZeRO 1-3.

A harness without its input (no --dschat-src, no OpenRLHF folder) is reported as not run, which
fails the target: the point of it is that both ran. --quick runs one case of each (a smoke run of
the harnesses, a few minutes). Results: <out>/dschat/report.md, <out>/openrlhf/summary.md and
<out>/trl/summary.md.
"""
import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DSCHAT_ONE_BACKWARD = ["0,0", "2,2", "2,3", "3,3"]


def dschat_commands(src, out, quick):
    run = [sys.executable, os.path.join(HERE, "deepspeed_chat", "run.py"), "--src", src, "--out", out]
    if quick:
        return [run + ["--pairs", "2,3", "--one-backward"]]
    return [run + ["--one-backward", *DSCHAT_ONE_BACKWARD],
            run + ["--pairs", "2,2", "--check-determinism"],
            run + ["--pairs", "3,3", "--hybrid"]]


def openrlhf_commands(packages, out, quick):
    run = [sys.executable, os.path.join(HERE, "openrlhf", "run.py"), "--out", out, "--packages", packages]
    return [run + (["--case", "dpo-z3-bf16"] if quick else [])]


def trl_commands(src, out, quick):
    run = [sys.executable, os.path.join(HERE, "trl", "run.py"), "--out", out, "--trl-src", src]
    return [run + (["--scripts", "distillation", "--stages", "1"] if quick else [])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dschat-src", help="applications/DeepSpeed-Chat of a DeepSpeedExamples checkout")
    ap.add_argument("--openrlhf-packages", help="a `pip install --target` folder holding openrlhf==0.11.0")
    ap.add_argument("--trl-src", help="a TRL checkout (its examples/scripts; the library is the installed TRL)")
    ap.add_argument("--only", choices=["dschat", "openrlhf", "trl"])
    ap.add_argument("--quick", action="store_true", help="one case of each harness")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    plan = {}
    if args.only in (None, "dschat"):
        plan["dschat"] = (dschat_commands(os.path.abspath(args.dschat_src), os.path.join(out, "dschat"), args.quick)
                          if args.dschat_src else None)
    if args.only in (None, "openrlhf"):
        plan["openrlhf"] = (openrlhf_commands(os.path.abspath(args.openrlhf_packages), os.path.join(out, "openrlhf"),
                                              args.quick) if args.openrlhf_packages else None)
    if args.only in (None, "trl"):
        plan["trl"] = (trl_commands(os.path.abspath(args.trl_src), os.path.join(out, "trl"), args.quick)
                       if args.trl_src else None)
    status = {}
    for name, commands in plan.items():
        if commands is None:
            status[name] = "not run (its input was not given: see --help)"
            continue
        start, rcs = time.time(), []
        for cmd in commands:
            print("$ " + " ".join(cmd), flush=True)
            rcs.append(subprocess.call(cmd))
        status[name] = ("passed" if not any(rcs) else f"failed (exit {rcs})") + f" in {time.time() - start:.0f} s"
    print()
    for name, what in status.items():
        print(f"{name}: {what}")
    return 0 if all(s.startswith("passed") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
