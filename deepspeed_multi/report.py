"""What this environment is, for a bug report: ``python -m deepspeed_multi.report [--build]``.

Prints a plain-text table: deepspeed_multi's version and location; Python; each package
deepspeed_multi runs with, its installed version, the window it was tested in and a verdict
(``inside``, ``outside``, ``refused`` or ``not installed``); the accelerator and the distributed
backend DeepSpeed picks; the fused-reduce op's build state; the fast-path switches; and the
environment variables that change what the package does. ``deepspeed_multi.report()`` prints the same.

Nothing here holds a version number: each window is read from the code that enforces it
(``compat.SUPPORTED``, ``transformers.TESTED``, ``lightning.versions.TESTED``) or from
deepspeed_multi's installed requirements (pyproject.toml). The report builds nothing unless
``--build`` is given; an optional package that fails to import is reported, not raised.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.metadata as md
import importlib.util
import os
import platform
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

VERDICTS = ("inside", "outside", "refused", "not installed")

# (distribution, module to import, where its window comes from): ("requirement",) is deepspeed_multi's own
# requirement or extra (pyproject.toml, as installed), ("deepspeed",) is compat.SUPPORTED (enforced at
# initialize), ("tested", (module, name), key, switch) is a major.minor literal in a module that refuses other
# releases unless the switch (a constant of switches.py) is on; switch None: shown, never refused.
_TRANSFORMERS = ("deepspeed_multi.transformers", "TESTED")
_LIGHTNING = ("deepspeed_multi.lightning.versions", "TESTED")
PACKAGES = (
    ("torch", "torch", ("requirement",)),
    ("deepspeed", "deepspeed", ("deepspeed",)),
    ("accelerate", "accelerate", ("requirement",)),
    ("transformers", "transformers", ("tested", _TRANSFORMERS, "transformers", "ALLOW_UNTESTED_TRAINERS")),
    ("trl", "trl", ("tested", _TRANSFORMERS, "trl", "ALLOW_UNTESTED_TRAINERS")),
    ("peft", "peft", ("requirement",)),
    ("lightning", "lightning", ("tested", _LIGHTNING, None, "ALLOW_UNTESTED_LIGHTNING")),
    # Parts of the same release train; deepspeed_multi.lightning imports and checks ``lightning`` only.
    ("pytorch_lightning", "pytorch_lightning", ("tested", _LIGHTNING, None, None)),
    ("lightning_fabric", "lightning_fabric", ("tested", _LIGHTNING, None, None)),
)
OPTIONAL_UNLISTED = ("pytorch_lightning", "lightning_fabric")  # shown only when installed

# Variables read outside switches.py (by this package, or by DeepSpeed and torch on its behalf), and why
# they matter. tests/unit/test_report.py checks that every name the package reads from os.environ is here.
ENVIRONMENT = (
    ("DS_ACCELERATOR", "DeepSpeed's accelerator (cpu, cuda, ...), read when deepspeed is imported"),
    ("TORCH_EXTENSIONS_DIR", "where DeepSpeed's JIT ops (the CPU shm comm op) are built"),
    ("CXX", "the C++ compiler of the fused-reduce build (default c++)"),
    ("CUDA_HOME", "the CUDA toolkit (nvcc) of the fused-reduce CUDA kernels"),
    ("TORCH_CUDA_ARCH_LIST", "the GPU architectures the CUDA kernels are compiled for"),
    ("MAX_JOBS", "parallel compile jobs of torch's JIT builds"),
    ("CUDA_VISIBLE_DEVICES", "the GPUs this process sees"),
    ("LOCAL_RANK", "this rank on its node (launcher)"),
    ("WORLD_SIZE", "ranks of the job (launcher): ZeRO-3 sub-groups sized from the model before the process group exists"),
    ("GROUP_RANK", "the node index (torchrun), for the watchdog and node-local checkpoints"),
    ("CROSS_RANK", "the node index (other launchers)"),
    ("SLURM_NODEID", "the node index under SLURM"),
    ("ACCELERATE_MIXED_PRECISION", "Accelerate's mixed precision (deepspeed_multi.accelerate)"),
    ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "needed with torchrun --max-restarts (docs/nodes.md)"),
)


# ----------------------------------------------------------------------------- helpers
def _shorten(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error(exc: BaseException) -> str:
    return _shorten(f"{type(exc).__name__}: {exc}")


def _version_tuple(text: str) -> Tuple[int, ...]:
    from packaging.version import Version
    return Version(text).release


def _installed(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _assigned_literal(module: str, name: str):
    """The literal assigned to ``name`` at the top of ``module``'s source, read without importing
    the module (deepspeed_multi.transformers imports Accelerate and Transformers)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise LookupError(f"{module} not found")
    for node in ast.parse(Path(spec.origin).read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    raise LookupError(f"{module}.{name} not found")


def _requirements() -> dict:
    """deepspeed_multi's installed requirements: {distribution: [(specifier, extra or None)]}."""
    from packaging.requirements import Requirement
    found: dict = {}
    for text in md.requires("deepspeed_multi") or []:
        req = Requirement(text)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", str(req.marker)) if req.marker else None
        key = re.sub(r"[-_.]+", "_", req.name).lower()
        spec = ",".join(sorted((str(s) for s in req.specifier), key=lambda s: (not s.startswith(">"), s)))
        found.setdefault(key, []).append((spec, extra.group(1) if extra else None))
    return found


def _try_import(module: str) -> Optional[str]:
    """None if ``module`` imports, else the error (its output goes to stderr, its warnings nowhere)."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - a broken package is reported, whatever it raises
        if isinstance(exc, KeyboardInterrupt):
            raise
        return _error(exc)
    return None


# ----------------------------------------------------------------------------- sections
Rows = List[Tuple[str, ...]]


def _about() -> Rows:
    import deepspeed_multi
    rows = [("version", deepspeed_multi.__version__),
            ("location", str(Path(deepspeed_multi.__file__).resolve().parent))]
    try:
        dist = md.distribution("deepspeed_multi")
        direct = dist.read_text("direct_url.json") or ""
        how = ("editable install" if '"editable": true' in direct
               else f"installed as {dist.metadata['Name']} {dist.version}")
        rows.append(("installed", f"{how} (metadata: {Path(str(dist.locate_file(''))).resolve()})"))
    except md.PackageNotFoundError:
        rows.append(("installed", "no metadata found (run from a source tree?)"))
    rows += [("python", f"{platform.python_version()} ({platform.python_implementation()}) {sys.executable}"),
             ("prefix", sys.prefix),
             ("platform", f"{platform.platform()}, {os.cpu_count()} CPUs")]
    return rows


def _window(kind, dist: str, requirements: dict):
    """(window text, inside(version) -> bool, refused when outside?, note)."""
    from . import compat, switches
    if kind[0] == "deepspeed":
        lo, hi = compat.SUPPORTED
        allow = switches.ALLOW_UNSUPPORTED_DEEPSPEED
        allowed = switches.switch_on(allow, False)
        effect = "1: runs with every fast path off" if allowed else "1 runs it anyway"
        note = f"compat.SUPPORTED, checked at initialize ({allow}={effect})"
        return f"{lo} to {hi}", lambda v: compat.in_window(v), not allowed, note
    if kind[0] == "requirement":
        specs = requirements.get(re.sub(r"[-_.]+", "_", dist).lower())
        if not specs:
            return "unknown", None, False, ("not among deepspeed_multi's installed requirements" if requirements
                                            else "deepspeed_multi's metadata (its requirements) not found")
        from packaging.specifiers import SpecifierSet
        spec = specs[0][0]
        extras = sorted({e for _, e in specs if e})
        where = f"extra {', '.join(extras)}" if extras else "requirement"
        return spec, lambda v: SpecifierSet(spec).contains(v, prereleases=True), False, \
            f"deepspeed_multi's {where} (pyproject.toml); not checked at run time"
    _, (module, name), key, switch = kind
    tested = _assigned_literal(module, name)
    tested = tested[key] if key else tested
    window = ", ".join(f"{t}.x" for t in tested)
    inside = lambda v: _version_tuple(v)[:2] in [_version_tuple(t) for t in tested]  # noqa: E731
    if switch is None:
        return window, inside, False, f"{module}.{name} (lightning's release); not checked"
    env = getattr(switches, switch)
    allowed = switches.switch_on(env, False)
    by = module.rsplit(".versions", 1)[0]
    note = f"{module}.{name}, checked by {by} ({env}={'1: allowed' if allowed else '1 runs it anyway'})"
    return window, inside, not allowed, note


def _packages() -> Rows:
    rows: Rows = [("package", "installed", "tested window", "verdict", "from / note")]
    try:
        requirements = _requirements()
    except md.PackageNotFoundError:
        requirements = {}  # run from a source tree: the requirement windows read "unknown"
    for dist, module, kind in PACKAGES:
        version = _installed(dist)
        if version is None and dist in OPTIONAL_UNLISTED:
            continue
        try:
            window, inside, refuses, note = _window(kind, dist, requirements)
        except Exception as exc:  # noqa: BLE001
            window, inside, refuses, note = "unknown", None, False, f"window unreadable: {_error(exc)}"
        if version is None:
            verdict = "not installed"
        elif inside is None:
            verdict = "outside"
            note = f"no window to compare with; {note}"
        else:
            try:
                verdict = "inside" if inside(version) else ("refused" if refuses else "outside")
            except Exception as exc:  # noqa: BLE001 - an unparsable version
                verdict, note = "outside", f"version not comparable ({_error(exc)}); {note}"
        if version is not None:
            failed = _try_import(module)
            if failed:
                note = f"IMPORT FAILS: {failed}; {note}"
        rows.append((dist, version or "-", window, verdict, note))
    return rows


def _accelerator() -> Rows:
    import torch
    env = os.environ.get("DS_ACCELERATOR")
    rows = [("DS_ACCELERATOR", env if env is not None else "unset (DeepSpeed detects one)")]
    try:
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        rows.append(("DeepSpeed accelerator", f"{acc.device_name()} ({type(acc).__name__})"))
        rows.append(("distributed backend", f"{acc.communication_backend_name()} (what deepspeed.init_distributed uses "
                                            "by default)"))
    except Exception as exc:  # noqa: BLE001
        rows.append(("DeepSpeed accelerator", f"unavailable: {_error(exc)}"))
    dist = torch.distributed
    if dist.is_available():
        have = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
        rows.append(("torch.distributed", f"available; backends built in: {', '.join(have) or 'none'}"))
    else:
        rows.append(("torch.distributed", "not available in this torch build"))
    cuda = torch.cuda.is_available()
    built = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "torch built without CUDA"
    rows.append(("CUDA available", f"{cuda} ({built})"))
    if cuda:
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        rows.append(("CUDA devices", f"{count}: {', '.join(names)}"))
    else:
        rows.append(("CUDA devices", "0"))
    rows.append(("torch threads", str(torch.get_num_threads())))
    return rows


def _ops(build: bool) -> Rows:
    from .ops import builder, fused_reduce
    from . import switches
    cuda = builder.with_cuda()
    name = builder.extension_name(cuda)
    package_csrc = Path(builder.__file__).resolve().parents[1] / "csrc"
    where = "inside the package" if builder.CSRC == package_csrc else "the source checkout: an editable install"
    sources = builder.CPU_SOURCES + builder.CUDA_SOURCES
    missing = [s for s in sources if not (builder.CSRC / s).exists()]
    rows = [("sources", f"{builder.CSRC} ({where}){'; MISSING: ' + ', '.join(missing) if missing else ''}")]
    if cuda:
        kernels = "CPU and CUDA"
    else:
        import torch
        why = ("no GPU visible" if not torch.cuda.is_available() else "torch built without CUDA"
               if torch.version.cuda is None else "nvcc not found (CUDA_HOME)")
        kernels = f"CPU only ({why})"
    rows.append(("kernels", f"{kernels}: module {name}"))
    try:
        builder.check_toolchain()
        rows.append(("toolchain", f"ninja and {os.environ.get('CXX', 'c++')} found"))
    except builder.BuildError as exc:
        rows.append(("toolchain", _shorten(str(exc))))
    override = switches.value(switches.BUILD_DIR)
    rows.append(("build directory", f"{builder.build_dir(cuda)}"
                                    f"{' (' + switches.BUILD_DIR + ')' if override else ''}"))
    rows.append(("build key", builder.build_key(cuda) + (f" (not used: {switches.BUILD_DIR} is set)" if override else
                                                         " (environment, sources, flags)")))
    if build:
        try:
            builder.load()
        except builder.BuildError:
            pass  # reported below from the loader's cache
    cached = builder._cache.get(name)
    error = "none in this process (the report builds nothing without --build)"
    if isinstance(cached, builder.BuildError):
        state = "failed (in this process)"
        error = _shorten(str(cached), 600)
    elif cached is not None:
        state = f"built, loaded ({cached.__file__}; CUDA kernels: {getattr(cached, 'has_cuda', '?')})"
        error = "none"
    else:
        directory = builder.build_dir(cuda)
        found = sorted(directory.glob(f"{name}*.so")) if directory.is_dir() else []
        if found:
            state = f"built (on disk: {found[0]}; not loaded by the report)"
        elif directory.is_dir():
            state = "tried, no module on disk (a build failed or was killed midway; --build retries and shows why)"
        else:
            state = "never tried (python -m deepspeed_multi.ops.build builds it)"
    rows += [("state", state), ("last build error", error)]
    mode = switches.value(fused_reduce.ENV, "auto")
    chosen = fused_reduce._backend
    rows.append(("backend", f"{fused_reduce.ENV}={mode}; in this process: "
                            f"{'not chosen yet (chosen at first use)' if chosen is None else chosen}"))
    return rows


def _switch_docs() -> List[Tuple[str, str, str, str]]:
    """(constant, variable, section, meaning) for each switch, read from switches.py: a block of comment
    lines opens a section; a switch means its trailing comment, else its section's text."""
    from . import switches
    section, block, after_comment, found = "", [], False, []
    for line in Path(switches.__file__).read_text().splitlines():
        comment = re.match(r"^#\s*(.*)$", line)
        if comment:
            block = (block if after_comment else []) + [comment.group(1)]
            section = " ".join(block)
        else:
            match = re.match(r'^([A-Z][A-Z0-9_]*)\s*=\s*"([A-Z][A-Z0-9_]*)"\s*(?:#\s*(.*))?$', line)
            if match:
                const, env, trailing = match.groups()
                found.append((const, env, section, trailing or section))
        after_comment = bool(comment)
    return found


def _switches() -> Rows:
    from . import switches
    rows: Rows = [("switch", "set to", "in effect", "what it does")]
    for const, env, section, meaning in _switch_docs():
        if not section.startswith("Fast paths") and env != switches.CHECK_RANK_AGREEMENT:
            continue
        raw = os.environ.get(env)
        rows.append((env, "unset" if raw is None else repr(raw), "on" if switches.switch_on(env) else "off", meaning))
    return rows


def _environment() -> Rows:
    from . import switches
    rows: Rows = [("variable", "value", "what it changes")]
    docs = {env: meaning for _, env, _, meaning in _switch_docs()}
    shown = {row[0] for row in _switches()[1:]}  # with their effect, in the section above
    names = [(env, docs.get(env, "")) for env in switches.ALL if env not in shown] + list(ENVIRONMENT)
    for env, meaning in names:
        raw = os.environ.get(env)
        rows.append((env, "unset" if raw is None else repr(raw), meaning))
    return rows


SECTIONS: Tuple[Tuple[str, Callable[..., Rows]], ...] = (
    ("deepspeed_multi", _about),
    ("packages", _packages),
    ("accelerator", _accelerator),
    ("fused-reduce op", _ops),
    ("fast-path switches", _switches),
    ("environment", _environment),
)


# ----------------------------------------------------------------------------- output
def _table(rows: Rows) -> List[str]:
    width = max(len(r) for r in rows)
    cols = [max((len(r[i]) for r in rows if i < len(r) - 1), default=0) for i in range(width - 1)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:-1], cols)) + ("  " if len(r) > 1 else "") + r[-1]
            for r in rows]


def render(build: bool = False) -> str:
    """The report as text (see the module docstring)."""
    lines = ["deepspeed_multi report (paste all of it into a bug report)"]
    for title, collect in SECTIONS:
        lines += ["", f"[{title}]"]
        try:
            rows = collect(build) if collect is _ops else collect()
        except Exception as exc:  # noqa: BLE001 - one broken section never hides the others
            rows = [("error", f"could not collect this section: {_error(exc)}")]
        lines += [line.rstrip() for line in _table(rows)]
    return "\n".join(lines) + "\n"


def report(build: bool = False, file=None) -> None:
    """Print the environment report for bug reports (also ``python -m deepspeed_multi.report``).

    Versions of torch, DeepSpeed and the integrations, whether the installed DeepSpeed is in the
    supported window, the fused-reduce op's state and the ``DSM_*`` switches set.

    Args:
        build (bool): first build the fused-reduce op if it is not built (otherwise its state is only read).
        file: where to print; default ``sys.stdout``.
    """
    print(render(build), end="", file=file or sys.stdout, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_multi.report", description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true",
                        help="build the fused-reduce op first if it is not built (else its state is only read)")
    args = parser.parse_args(argv)
    report(build=args.build)
    return 0


class _CallableModule(types.ModuleType):
    """``deepspeed_multi.report`` is this module (the package exports it); calling it prints the report."""

    def __call__(self, build: bool = False, file=None) -> None:
        report(build=build, file=file)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
