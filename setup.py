"""Build hook only: the metadata (name, version, dependencies, extras) is in pyproject.toml.

The wheel carries csrc/ inside the package, so that a non-editable install can JIT-build the
fused-reduce extension (deepspeed_multi/ops/builder.py looks there first), and the two data files
compat.py reads.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package, so that a non-editable install can JIT-build the extension."""

    def run(self):
        super().run()
        shutil.copytree(Path(__file__).resolve().parent / "csrc", Path(self.build_lib) / "deepspeed_multi" / "csrc",
                        dirs_exist_ok=True)


setup(
    package_data={"deepspeed_multi": ["touch_points.tsv", "checked_sources.tsv"]},  # read by compat.py
    cmdclass={"build_py": BuildPyWithSources},
)
