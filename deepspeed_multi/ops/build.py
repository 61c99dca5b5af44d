"""Prebuild the fused-reduce extension: ``python -m deepspeed_multi.ops.build [--verbose]``.

Run it once per machine/image (e.g. before launching ranks) so that training starts with a
warm cache; it prints the build directory and the module file, or the error and exits 1.
"""
from __future__ import annotations

import argparse
import sys

from . import builder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands and output")
    args = parser.parse_args(argv)
    cuda = builder.with_cuda()
    try:
        module = builder.load(verbose=args.verbose)
    except builder.BuildError as exc:
        print(f"build failed: {exc}", file=sys.stderr)
        return 1
    print(f"built {builder.extension_name(cuda)} (cuda kernels: {module.has_cuda}) in {builder.build_dir(cuda)}")
    print(f"module: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
