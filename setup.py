"""Install ds_pseudo_real: Pseudo-to-Real training and granular CPU offload for DeepSpeed and Megatron.

Install torch first (``pip install torch==2.13.0`` on the CPU machines this project is tested on): no torch
version is pinned here so that pip never replaces the one already installed.
"""
from setuptools import find_packages, setup

# What Megatron-LM's training package (a checkout on PYTHONPATH, see README "Megatron-LM") imports beyond
# megatron-core: pretrain_gpt.py's initialize imports triton unconditionally, even on CPU.
MEGATRON_LM = ["megatron-core==0.16.1", "six", "regex", "einops", "pyyaml", "triton"]

setup(
    name="ds_pseudo_real",
    version="0.1.0",
    description="Pseudo-to-Real (sharing -> delinking) pretraining and granular CPU offload for DeepSpeed/Megatron",
    packages=find_packages(include=["ds_pseudo_real*", "megatron_patches*", "launch*"]),
    package_data={"ds_pseudo_real.offload": ["csrc/*.cpp"]},  # the host step's op, built on first use
    python_requires=">=3.10",
    install_requires=["torch", "deepspeed>=0.19", "pydantic>=2", "numpy", "matplotlib", "ninja"],
    extras_require={
        "megatron": ["megatron-core==0.16.1"],
        "megatron-lm": MEGATRON_LM,
        "data": ["megatron-core==0.16.1", "tokenizers"],
        "hf": ["transformers>=4.40"],
        "monitor": ["tensorboard"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", *MEGATRON_LM, "tokenizers", "transformers>=4.40", "tensorboard"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "console_scripts": ["ds-pseudo-real=ds_pseudo_real.cli:main"],
        # the subcommands of ds-pseudo-real (ds_pseudo_real/cli.py dispatches to them)
        "ds_pseudo_real.commands": [
            "train=launch.train:main",
            "preprocess=ds_pseudo_real.preprocess:main",
            "convert=ds_pseudo_real.checkpointing.convert:main",
            "plan=ds_pseudo_real.plan_command:main",
            "slurm=launch.slurm:main",
            "hostfile=launch.hostfile:main",
        ],
    },
)
