#!/usr/bin/env bash
# The GPU checks of docs/gpu.md as one prepared run for a lent CUDA machine, in priority order
# under one time budget (a lease is short: a step that would not fit is cut to what is left, and
# one with under 30 s left is skipped and says so in steps.txt).
#
#   benchmarks/gpu_lease.sh OUT_DIR [BUDGET_SECONDS]   (default budget 540 s)
#
# Steps, each with its own log in OUT_DIR:
#   1. gpu_engine.json  python benchmarks/gpu.py --parts decode-profile,engine-decode,throughput,w4a16
#                     on the Qwen3-0.6B and Llama-3.2-1B shapes, no HF baseline (issue 46's GPU
#                     targets: batch-1 decode with CUDA graphs, nano-vllm's workload; where a
#                     batch-1 step's time goes; the 4-bit Triton matmul against bf16)
#   2. gpu_tests.log  pytest -m gpu on the tests that need no model package: the Triton kernels
#                     compiled for the card (fp16, bf16; the fp32 variant compiles for minutes) and
#                     float8 weights (the other gpu tests load SmolLM2's package, too big to carry)
#   3. gpu.json       the attention part (paged decode and prefill kernels against SDPA), bf16
# env.txt holds nvidia-smi and the versions; steps.txt each step's exit status and seconds.
# Run it with KVSERVE_COMMIT set to the commit the tree was sent from: the lease's copy sits
# beside an older .git (benchmarks/common.git_commit records KVSERVE_COMMIT in the results files).
# Seen on an H200 (2026-11-27, 2026-11-28): every part with HF baselines on three models did not
# fit in 390 s (HF `generate` takes 80-90 s per model), and step 2 needs more than 140 s with a
# cold Triton cache (97 s with a warm one); the attention part was last measured at a95b395.
set -u
out=${1:?usage: benchmarks/gpu_lease.sh OUT_DIR [BUDGET_SECONDS]}
budget=${2:-540}
py=${PYTHON:-python3}
start=$(date +%s)
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1

{
    nvidia-smi
    "$py" -c 'import sys, torch, triton, transformers; print(sys.version); print("torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
    echo "KVSERVE_COMMIT=${KVSERVE_COMMIT:-unset}"
} > "$out/env.txt" 2>&1

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$(( budget - ($(date +%s) - start) ))
    if (( left < 30 )); then
        echo "$name skipped: ${left}s of the budget left" >> "$out/steps.txt"
        return
    fi
    (( limit > left )) && limit=$left
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - t0 ))s (limit ${limit}s)" >> "$out/steps.txt"
}

step gpu_engine 330 "$py" benchmarks/gpu.py --parts decode-profile,engine-decode,throughput,w4a16 \
    --models qwen3-0.6b,llama-3.2-1b --no-hf --out "$out/gpu_engine.json"
step gpu_tests 150 "$py" -m pytest -m gpu -k "not fp32" -q -p no:cacheprovider --continue-on-collection-errors \
    tests/kernels/test_triton_attention.py tests/engine/test_fp8_weights.py
step gpu 200 "$py" benchmarks/gpu.py --parts attention --out "$out/gpu.json"
cat "$out/steps.txt"
