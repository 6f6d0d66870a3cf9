"""vescale-zero: RaggedShard FSDP for PyTorch, DeepSpeed and Megatron-Core.

The ranges below are the ones CI tests, nothing wider (README, "Supported versions"): from the
oldest to the newest minor release of each host that CI installs, any patch release of those
(vescale_zero/host_patches.py ``HOST_VERSIONS`` names them; tests/test_host_releases.py checks
that the two agree). torch: any build (production installs bring their own CUDA build; on CPU
machines install ``torch==2.13.0`` first, or pip fetches a multi-GB CUDA build). megatron-core
0.17 and later declare Python >= 3.12: on 3.12 ``pip install -e '.[megatron]'`` takes the newest;
on 3.11 pip stops at 0.16.1 unless the newer wheel is installed first with
``--ignore-requires-python`` (docs/testing.md), which the extra then keeps.
"""

from setuptools import find_packages, setup

TORCH = "torch>=2.11,<2.16"  # CI: 2.13.0 (full suite), 2.11.0 and 2.15.0 (quick subset)
DEEPSPEED = "deepspeed>=0.16,<0.20"  # CI: 0.16.9, 0.17.6, 0.18.9, 0.19.8
MEGATRON = "megatron-core>=0.15,<0.20"  # CI: 0.15.3, 0.16.1, 0.17.1, 0.18.2, 0.19.2
TRANSFORMERS = "transformers>=4.57,<5.25"  # CI: 4.57.6, 5.24.0
ACCELERATE = "accelerate>=1.10,<1.16"  # CI: 1.10.1, 1.15.0
TRL = "trl>=1.10,<1.17"  # CI: 1.10.0, 1.16.0
PEFT = "peft>=0.18,<0.22"  # CI: 0.18.1, 0.21.2
TORCHTITAN = "torchtitan>=0.3,<0.4"  # CI: 0.3.0 in the light venv .venv-hosts-0.18, beside torch 2.13.0

setup(
    name="vescale-zero",
    version="0.1.0",
    description="RaggedShard placement, structure-aware planner and zero-copy DBuffer for FSDP / ZeRO-3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # the registry's route patches read co_qualname (3.11+)
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
