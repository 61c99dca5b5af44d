"""deepspeed_multi: one plain ``loss.backward()`` through any number of DeepSpeed engines.

torch is stated as a range only; install the build you want first (the Makefile pins the CPU
build on CPU machines) so that pip never pulls a multi-GB CUDA wheel by accident.
"""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package, so that a non-editable install can JIT-build the extension."""

    def run(self):
        super().run()
        shutil.copytree(Path(__file__).resolve().parent / "csrc", Path(self.build_lib) / "deepspeed_multi" / "csrc",
                        dirs_exist_ok=True)


setup(
    name="deepspeed_multi",
    version="0.1.0",
    description="Hook-driven multi-engine backward for DeepSpeed, with a fused gradient-reduction extension",
    packages=find_packages(include=["deepspeed_multi", "deepspeed_multi.*"]),
    package_data={"deepspeed_multi": ["touch_points.tsv", "checked_sources.tsv"]},  # read by compat.py
    cmdclass={"build_py": BuildPyWithSources},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6,<2.16",  # measured at 2.6.0, 2.13.0, 2.14.1, 2.15.0 (docs/supported_releases.md)
        "deepspeed>=0.19.4,<=0.19.8",  # the supported window (compat.SUPPORTED; README "Supported DeepSpeed releases")
        "ninja",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout"],
        # deepspeed_multi.accelerate and Transformers support in zero_init. Install torch first:
        # these never pull a torch then (their torch requirement is already met). The transformers range
        # is deepspeed_multi.transformers.TESTED (make test runs both ends).
        "hf": ["accelerate==1.15.0", "transformers>=5.23.0,<5.25"],
        # deepspeed_multi.transformers with TRL's trainers (multi_engine_trainer, deepspeed_roles).
        "trl": ["accelerate==1.15.0", "transformers>=5.23.0,<5.25", "trl==1.16.0", "peft==0.21.2"],
        # deepspeed_multi.lightning (Fabric and the Trainer); the range is deepspeed_multi.lightning.TESTED.
        "lightning": ["lightning==2.6.6"],
    },
)
