"""vescale-zero: RaggedShard FSDP for PyTorch, DeepSpeed and Megatron-Core.

torch is a requirement but not pinned here: production installs bring their own CUDA
build. On CPU machines install ``torch==2.13.0`` first (see README), or pip fetches a
multi-GB CUDA build.
"""

from setuptools import find_packages, setup

setup(
    name="vescale-zero",
    version="0.1.0",
    description="RaggedShard placement, structure-aware planner and zero-copy DBuffer for FSDP / ZeRO-3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vescale_zero", "vescale_zero.*"])
    + ["vescale_zero.integrations", "vescale_zero.integrations.deepspeed", "vescale_zero.integrations.megatron"],
    package_dir={"vescale_zero.integrations": "integrations"},
    install_requires=["torch>=2.4", "numpy", "tqdm"],
    extras_require={
        "deepspeed": ["deepspeed>=0.16"],
        "megatron": ["megatron-core>=0.16,<0.18"],
        "plot": ["matplotlib"],
        "safetensors": ["safetensors"],
        "test": ["pytest>=8", "hypothesis>=6", "pytest-timeout", "deepspeed>=0.16", "megatron-core>=0.16.1,<0.18",
                 "matplotlib", "safetensors", "transformers>=5", "accelerate>=1", "ruff>=0.6",
                 "bitsandbytes>=0.50,<0.51", "trl>=1.16", "peft>=0.21"],
    },
    entry_points={"console_scripts": ["vescale-zero=vescale_zero.cli:main"]},
)
