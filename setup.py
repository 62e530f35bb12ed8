"""Install ds_pseudo_real: Pseudo-to-Real training and granular CPU offload for DeepSpeed and Megatron.

Install torch first (``pip install torch==2.13.0`` on the CPU machines this project is tested on): no torch
version is pinned here so that pip never replaces the one already installed.
"""
from setuptools import find_packages, setup

setup(
    name="ds_pseudo_real",
    version="0.1.0",
    description="Pseudo-to-Real (sharing -> delinking) pretraining and granular CPU offload for DeepSpeed/Megatron",
    packages=find_packages(include=["ds_pseudo_real*", "megatron_patches*", "launch*"]),
    python_requires=">=3.10",
    install_requires=["torch", "deepspeed>=0.19", "pydantic>=2", "numpy", "matplotlib", "ninja"],
    extras_require={
        "megatron": ["megatron-core==0.16.1"],
        "hf": ["transformers>=4.40"],
        "monitor": ["tensorboard"],
        "test": ["pytest>=8", "megatron-core==0.16.1", "transformers>=4.40", "tensorboard"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["ds-pseudo-real=ds_pseudo_real.cli:main"]},
)
