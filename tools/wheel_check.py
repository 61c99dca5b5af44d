"""Build the sdist and the wheel, install the wheel in a fresh environment, and run it from there.

    python tools/wheel_check.py [--drop MEMBER] [--keep]      (make test-wheel)

What a user gets from ``pip install deepspeed_multi`` is the wheel, not this checkout: a file the
package reads at run time (a .tsv, a csrc/ source) that the build leaves out passes every test in the
checkout and fails only after installation. So, in a temporary folder outside the checkout:

1. the sdist is built from the checkout's files (tracked and not ignored), and the wheel from the
   unpacked sdist (so the sdist is checked to build on its own), both with torch and DeepSpeed made
   unimportable (the version is read from deepspeed_multi/__init__.py's text, never by importing it);
2. the wheel's file list is compared with what the package needs: every .py and .tsv under
   deepspeed_multi/, every file under csrc/ (as deepspeed_multi/csrc/), LICENSE and NOTICE in the
   .dist-info; a missing file fails, named;
3. a fresh venv (``--without-pip``, no system site-packages) gets the wheel installed, not editable, and
   this interpreter's site-packages through a .pth file (torch, DeepSpeed, ... without reinstalling them);
   ``deepspeed_multi`` must be imported from that venv, never from the checkout;
4. there: ``python -m deepspeed_multi.ops.build`` (the fused op JIT-built from the wheel's csrc/ into a
   fresh DSM_BUILD_DIR), ``python -m deepspeed_multi.report`` (which must say built, sources inside the
   package) and examples/demo.py on two CPU ranks, as ``make demo`` runs it.

``--drop MEMBER`` removes a member from the built wheel before step 2 (to see the check fail).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "deepspeed_multi"
LICENSE_FILES = ("LICENSE", "NOTICE")


class Failed(Exception):
    pass


STARTED = time.monotonic()


def say(message: str) -> None:
    print(f"wheel check [{time.monotonic() - STARTED:4.0f} s]: {message}", flush=True)


def run(cmd, cwd, env=None, timeout=600, capture=False) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)
    if done.returncode != 0:
        if capture:
            print(done.stdout)
        raise Failed(f"`{' '.join(str(c) for c in cmd)}` exited {done.returncode} (in {cwd})")
    return done.stdout or ""


def checkout_files() -> list[str]:
    """The checkout's files as the sdist sees them: tracked or untracked, not ignored, present."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def build_env(tmp: Path) -> dict:
    """The environment of the builds: torch and DeepSpeed raise on import, so a build that imports the
    package (to read its version, say) fails here instead of silently needing them."""
    poison = tmp / "unimportable"
    for name in ("torch", "deepspeed"):
        (poison / name).mkdir(parents=True)
        (poison / name / "__init__.py").write_text(f"raise ImportError('{name} was imported at build time')\n")
    return dict(os.environ, PYTHONPATH=str(poison))


def build(tmp: Path, files: list[str]) -> Path:
    src, dist = tmp / "src", tmp / "dist"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    env = build_env(tmp)
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    sdist = run([sys.executable, "-c", code], src, env, capture=True).strip().splitlines()[-1]
    say(f"sdist {sdist}")
    with tarfile.open(dist / sdist) as archive:
        archive.extractall(tmp / "sdist", filter="data")
    (unpacked,) = (tmp / "sdist").iterdir()
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist,
         unpacked], tmp, env, capture=True)
    (wheel,) = dist.glob("*.whl")
    say(f"wheel {wheel.name}")
    return wheel


def drop(wheel: Path, member: str) -> None:
    """Rewrite the wheel without ``member`` (the check must then fail, naming it)."""
    rebuilt = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_DEFLATED) as new:
        if member not in old.namelist():
            raise Failed(f"--drop {member}: not in the wheel")
        for item in old.infolist():
            if item.filename != member:
                new.writestr(item, old.read(item.filename))
    rebuilt.replace(wheel)
    say(f"dropped {member} from the wheel (--drop)")


def check_contents(wheel: Path, files: list[str]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
    dist_info = next((m.split("/")[0] for m in members if m.split("/")[0].endswith(".dist-info")), None)
    needed = [f for f in files if f.startswith(f"{PACKAGE}/") and f.endswith((".py", ".tsv"))]
    needed += [f"{PACKAGE}/{f}" for f in files if f.startswith("csrc/")]
    needed += [f"{dist_info}/licenses/{name}" for name in LICENSE_FILES]
    missing = [f for f in needed if f not in members]
    if missing:
        raise Failed(f"the wheel lacks {len(missing)} file(s) the package needs: {', '.join(missing)}")
    say(f"the wheel has all {len(needed)} files the package needs ({len(members)} members)")


def make_venv(tmp: Path, wheel: Path) -> tuple[Path, Path]:
    venv = tmp / "venv"
    # The base interpreter, not this venv's: the new environment must not inherit this one.
    run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", venv], tmp)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp,
                    capture=True).strip())
    # torch, DeepSpeed and the rest from this environment, appended after the venv's own site-packages.
    # A path in a .pth file is added as it is: the .pth files there (this checkout's editable install) are
    # not read, so the checkout stays off sys.path.
    (site / "this_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, wheel], tmp,
        capture=True)
    return python, site


def isolated_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(DS_ACCELERATOR="cpu", DSM_BUILD_DIR=str(tmp / "dsm_build"))
    return env


def check_installed(python: Path, site: Path, env: dict, cwd: Path) -> None:
    where = run([python, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"], cwd, env, capture=True)
    where = Path(where.strip().splitlines()[-1]).resolve()
    if site.resolve() not in where.parents:
        raise Failed(f"{PACKAGE} was imported from {where}, not from the wheel installed in {site}")
    say(f"{PACKAGE} imports from {where.parent}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drop", metavar="MEMBER", help="remove this member from the built wheel (e.g. "
                        f"{PACKAGE}/checked_sources.tsv): the check must then fail, naming it")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dsm-wheel-check-"))
    try:
        if ROOT in tmp.parents:
            raise Failed(f"the temporary folder {tmp} is inside the checkout")
        files = checkout_files()
        wheel = build(tmp, files)
        if args.drop:
            drop(wheel, args.drop)
        check_contents(wheel, files)
        python, site = make_venv(tmp, wheel)
        env = isolated_env(tmp)
        work = tmp / "run"
        (work / "examples").mkdir(parents=True)
        check_installed(python, site, env, work)
        say("building the fused op from the wheel's csrc/ (python -m deepspeed_multi.ops.build)")
        run([python, "-m", f"{PACKAGE}.ops.build"], work, env)
        say("python -m deepspeed_multi.report")
        report = run([python, "-m", f"{PACKAGE}.report"], work, env, capture=True)
        print(report, end="")
        lines = {line.split(None, 1)[0]: line for line in report.splitlines() if line.startswith("  ")}
        if not lines.get("state", "").split(None, 1)[-1].startswith("built"):
            raise Failed(f"the report does not say the fused op is built: {lines.get('state')!r}")
        if "inside the package" not in lines.get("sources", ""):
            raise Failed(f"the fused op's sources are not read from the installed package: {lines.get('sources')!r}")
        for name in ("demo.py", "_util.py"):  # demo.py imports _util from its own folder
            shutil.copy2(ROOT / "examples" / name, work / "examples" / name)
        say("examples/demo.py on 2 CPU ranks (as make demo)")
        run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "demo.py"],
            work / "examples", env)
    except (Failed, subprocess.TimeoutExpired) as exc:
        say(f"FAILED: {exc}")
        return 1
    finally:
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    say("passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
