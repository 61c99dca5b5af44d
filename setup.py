"""deepspeed_multi: one plain ``loss.backward()`` through any number of DeepSpeed engines.

torch is stated as a range only; install the build you want first (the Makefile pins the CPU
build on CPU machines) so that pip never pulls a multi-GB CUDA wheel by accident.
"""
from setuptools import find_packages, setup

setup(
    name="deepspeed_multi",
    version="0.1.0",
    description="Hook-driven multi-engine backward for DeepSpeed, with a fused gradient-reduction extension",
    packages=find_packages(include=["deepspeed_multi", "deepspeed_multi.*"]),
    package_data={"deepspeed_multi": ["csrc/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.15",
        "deepspeed>=0.19.8,<0.20",
        "ninja",
    ],
    extras_require={"test": ["pytest>=8", "pytest-timeout"]},
)
