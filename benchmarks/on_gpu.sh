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
# then there (the device tool, carry [".whl"]):  bash benchmarks/on_gpu.sh checks   (then: large)
#   checks: DeepSpeed installed, the GPU-only tests (tests/rl_actors/test_cuda.py), one step of a random
#           model of SmolLM2's width and depth (576 x 12, 46.5M matmul parameters), ours against a plain
#           loop, captured then eager decoding (about 3 minutes on an H200, the install included);
#   large:  the same step on a 1536 x 28 body (771M with the tiny vocabulary), micro-batch 64 then 16.
# Our rank is one bf16 rank configured ZeRO-2, which runs as ZeRO-1 (rl_actors.deepspeed_rank.engine_stage).
# Each part writes its log and its table under $OUT; a part that runs out of its time is stopped and the
# next one runs; the script exits non-zero if any part failed.
set -uo pipefail
part=${1:-checks}
case $part in checks | large) ;; *) echo "on_gpu.sh: no part '$part' (checks, large)" >&2; exit 2 ;; esac
failed=0
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
    local rc=$?
    echo "rc $rc after $SECONDS s"
    [ "$rc" -eq 0 ] || failed=1
    tail -40 "$OUT/$name.log"
}

case $part in
checks)
    timeout 240 python3 -m pytest -p no:cacheprovider -q -rs tests/rl_actors/test_cuda.py > "$OUT/tests.log" 2>&1 \
        || failed=1
    tail -30 "$OUT/tests.log"
    step smollm2_shape_captured 150 --hidden 576 --layers 12 --decode captured
    step smollm2_shape_eager 120 --hidden 576 --layers 12 --decode eager
    ;;
large)
    step large_mb64 200 --hidden 1536 --layers 28 --micro-batch 64
    step large_mb16 200 --hidden 1536 --layers 28 --micro-batch 16
    ;;
esac
exit "$failed"
