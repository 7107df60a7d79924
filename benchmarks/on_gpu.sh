#!/usr/bin/env bash
# What a session runs when it is lent a GPU machine (docs/benchmarks.md has what earlier ones found).
# That machine has torch and transformers but no Ray, vLLM or DeepSpeed, and no network, so the checks
# drive the actor classes in one process, and DeepSpeed travels as its source package. Here, first:
#
#   echo /.whl/ >> .git/info/exclude; mkdir -p .whl
#   python3 -m pip download --no-deps --no-binary :all: -d .whl deepspeed==0.19.8
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       hjson pydantic pydantic-core annotated-types typing-inspection
#
# then there (the device tool, carry [".whl"]):  bash benchmarks/on_gpu.sh checks  (then: large)
#   checks: DeepSpeed installed, the GPU-only tests (tests/rl_actors/test_cuda.py), one step of a random
#           model of SmolLM2's width and depth (576 x 12), ours against a plain loop, captured then eager
#           decoding;
#   large:  the same step on a 1.3B body (1536 x 28), micro-batch 64, ZeRO-2 then ZeRO-1.
# Each part writes its log and its table under $OUT; a part that runs out of its time is stopped and the
# next one runs.
set -u
OUT=${OUT:-/tmp/on_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! PYTHONPATH=/tmp/site python3 -c "import deepspeed" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl || exit 1
    DS_BUILD_OPS=0 PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-cache-dir --target /tmp/site .whl/deepspeed-*.tar.gz || exit 1
fi
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, \
deepspeed.__version__)" | tee -a "$OUT/gpu.txt"

step() {  # name, seconds, gpu_step.py flags
    local name=$1 limit=$2
    shift 2
    echo "== $name: gpu_step.py $*"
    timeout "$limit" python3 benchmarks/gpu_step.py --prompts 32 --group 8 --max-new-tokens 64 \
        --write "$OUT/$name.md" "$@" > "$OUT/$name.log" 2>&1
    echo "rc $? after $SECONDS s"
    tail -40 "$OUT/$name.log"
}

case ${1:-checks} in
checks)
    timeout 240 python3 -m pytest -p no:cacheprovider -q -rs tests/rl_actors/test_cuda.py 2>&1 | tail -30 \
        | tee "$OUT/tests.log"
    step smollm2_shape_captured 150 --hidden 576 --layers 12 --decode captured
    step smollm2_shape_eager 120 --hidden 576 --layers 12 --decode eager
    ;;
again)
    timeout 120 python3 -m pytest -p no:cacheprovider -q -rs tests/rl_actors/test_cuda.py 2>&1 | tail -30 \
        | tee "$OUT/tests.log"
    step smollm2_shape_zero1 100 --hidden 576 --layers 12 --zero-stage 1
    step large_zero2 240 --hidden 1536 --layers 28 --micro-batch 64 --zero-stage 2
    ;;
large)
    step large_zero2 240 --hidden 1536 --layers 28 --micro-batch 64 --zero-stage 2
    step large_zero1 200 --hidden 1536 --layers 28 --micro-batch 64 --zero-stage 1
    ;;
esac
