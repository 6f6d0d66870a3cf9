"""vescale-zero: RaggedShard FSDP for PyTorch, DeepSpeed and Megatron-Core.

The ranges below are the ones CI tests, nothing wider (README, "Install and run the tests"):
torch 2.11 to 2.15 (any build: production installs bring their own CUDA build; on CPU
machines install ``torch==2.13.0`` first, or pip fetches a multi-GB CUDA build), and the host
versions the adapters' patches were checked against (vescale_zero/host_patches.py,
``HOST_VERSIONS``). megatron-core 0.17+ needs Python 3.12, which CI does not have.
"""

from setuptools import find_packages, setup

TORCH = "torch>=2.11,<2.16"  # CI: 2.13.0 (full suite), 2.11.0 and 2.15.0 (quick subset)
DEEPSPEED = "deepspeed==0.19.8"
MEGATRON = "megatron-core==0.16.1"
TRANSFORMERS = "transformers==5.24.0"
ACCELERATE = "accelerate==1.15.0"
TRL = "trl==1.16.0"
PEFT = "peft==0.21.2"
TORCHTITAN = "torchtitan>=0.3.0,<0.4"  # CI: 0.3.0 in its own venv (.venv-titan), beside torch 2.13.0

setup(
    name="vescale-zero",
    version="0.1.0",
    description="RaggedShard placement, structure-aware planner and zero-copy DBuffer for FSDP / ZeRO-3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vescale_zero", "vescale_zero.*"])
    + ["vescale_zero.integrations", "vescale_zero.integrations.deepspeed", "vescale_zero.integrations.megatron",
       "vescale_zero.integrations.torchtitan"],
    package_dir={"vescale_zero.integrations": "integrations"},
    install_requires=[TORCH, "numpy", "tqdm"],
    extras_require={
        "deepspeed": [DEEPSPEED],
        "megatron": [MEGATRON],
        "plot": ["matplotlib"],
        "safetensors": ["safetensors"],
        "torchtitan": [TORCHTITAN, "triton"],
        "test": ["pytest>=8", "hypothesis>=6", "pytest-timeout", DEEPSPEED, MEGATRON, "matplotlib", "safetensors",
                 TRANSFORMERS, ACCELERATE, "ruff>=0.6", "bitsandbytes==0.50.2", TRL, PEFT],
    },
    entry_points={"console_scripts": ["vescale-zero=vescale_zero.tools.cli:main"]},
)
