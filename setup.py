"""Install: pip install -e .[test]   (CPU)   or   pip install -e .[gpu]   (adds Transformer Engine)."""
from setuptools import find_packages, setup

setup(
    name="mcore_dpo",
    version="0.1.0",
    description="Preference optimization (DPO family) on megatron-core with TP/PP/DP, launched by Ray",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["mcore_dpo", "mcore_dpo.*", "checkpoint_convert", "checkpoint_convert.*"]),
    package_data={"mcore_dpo": ["assets/*", "assets/**/*"]},
    include_package_data=True,
    # Each range is tested at both ends (docs/COMPATIBILITY.md, scripts/compat_check.sh); the README's
    # commands pin torch 2.13.0, the CPU build the main suite runs on. megatron-core 0.17+ needs Python 3.12+;
    # on Python 3.10 the newest releases are torch 2.14, megatron-core 0.16.1, transformers 5.20, matplotlib 3.10.
    install_requires=[
        "torch>=2.13.0,<2.16",
        "megatron-core>=0.16.1,<0.20",
        "ray>=2.50,<2.61",
        "transformers>=5.20,<5.25",
        "safetensors>=0.8,<0.9",
        "datasets>=5.2,<5.3",
        "pyyaml>=6.0,<7",
        "tensorboard>=2.21,<2.22",
        "matplotlib>=3.10,<3.12",
        "packaging>=24.2",
        "xxhash>=3",  # checkpoint checksums (checkpoint_convert/integrity.py); also a dependency of datasets
        "numpy>=1.26",  # the token store's memory-mapped arrays (mcore_dpo/data/store.py)
    ],
    extras_require={
        # Everything the test suite imports beyond install_requires.
        # peft: the LoRA parity and export tests (tested with 0.21.2). pytest-xdist: the fast tier's two
        # worker processes (tests/conftest.py; tested with 3.8.0).
        "test": ["pytest>=9.0,<10", "pytest-xdist>=3.8,<4", "pyarrow>=15", "tokenizers>=0.22,<1", "wandb>=0.31,<0.32", "peft==0.21.2",
                 "trl==1.16.0"],  # the objectives' parity tests call TRL 1.16's own trainers
        # Weights & Biases logging (--wandb).
        "wandb": ["wandb>=0.31,<0.32"],
        # benchmarks/vs_trl.py (TRL's DPOTrainer as the baseline); never imported by the package.
        "bench": ["trl>=1.16,<1.17"],
        # GPU users: Transformer Engine (needs CUDA). NVIDIA apex is optional and built from source; see README.
        "gpu": ["transformer-engine[pytorch]>=2.20,<2.21"],
    },
    entry_points={
        "console_scripts": [
            "mcore-dpo-train=mcore_dpo.train:main",
            "mcore-convert=checkpoint_convert.__main__:main",
        ],
        # `checkpoint_convert verify` builds the Megatron model with the trainer's builder, found here
        # (checkpoint_convert imports nothing from mcore_dpo; checkpoint_convert/verify.py).
        "checkpoint_convert.megatron_runners": [
            "mcore_dpo=mcore_dpo.tools.verify_runner:megatron_logits",
        ],
    },
)
