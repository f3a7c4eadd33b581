# GPU image: the NVIDIA PyTorch container (CUDA, NCCL, cuDNN, PyTorch, TransformerEngine, apex, flash-attn)
# plus this package and its Python dependencies. The base image's torch stays: a constraint pins pip to the
# installed build, on top of the base image's own PIP_CONSTRAINT. A batch image: no HEALTHCHECK, no entry
# point; run torchrun or examples/cluster/*.sh in it (docs/launch.md).
#
#   docker build -t rlhf .
#   docker run --gpus all --ipc=host --rm -v /data:/data -e OUT_DIR=/data/runs/7b \
#       rlhf /opt/rlhf/examples/cluster/single_node.sh llama2-7b-7b
FROM nvcr.io/nvidia/pytorch:25.04-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The tested megatron-core; setup.py allows its minor (>=0.16.1,<0.17). Moving on: docs/launch.md.
ARG MEGATRON_CORE_VERSION=0.16.1

WORKDIR /opt/rlhf
COPY setup.py pyproject.toml pretrain_rlhf.py train_reward.py ./
COPY rlhf ./rlhf
# the test extra: the suite's `gpu` tests run in the image (python -m pytest -m gpu tests)
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/keep-torch.txt \
    && pip install --no-cache-dir --constraint /tmp/keep-torch.txt \
        "megatron-core==${MEGATRON_CORE_VERSION}" ".[test]" \
    && python -c "import torch, megatron.core, rlhf; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" \
    && rm /tmp/keep-torch.txt
COPY README.md ./
COPY tools ./tools
COPY examples ./examples
COPY tests ./tests
COPY benchmarks ./benchmarks
COPY docs ./docs

RUN groupadd --gid 10001 rlhf && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash rlhf
USER 10001:10001
# runs write beside the working directory by default (OUT_DIR=runs/<example>): the user's home
WORKDIR /home/rlhf
