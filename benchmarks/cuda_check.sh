#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: conformance of the CUDA backend (its
# e2e suite replays CUDA graphs against eager), the kernel microbenchmark, the
# quantized-weight ops (FP8 GEMM, FP4 experts) against bf16, decode
# steps with and without CUDA graphs, greedy generation on --backend cuda vs cpu, and
# long-context prefill (seconds per chunk, peak memory) up to 1M tokens.
#
#   benchmarks/cuda_check.sh [--quick] [--model DIR]
#
# Creates .venv with `make setup` when it is missing (torch==2.13.0 from PyPI is
# the CUDA build on a Linux GPU host). Writes reports/cuda-conformance.json.
# Exit status: 1 when conformance fails or the fp32 greedy tokens differ, 2 when
# the GPU or the environment is not usable; benchmark numbers never fail it.
set -uo pipefail

cd "$(dirname "$0")/.."
QUICK=""
MODEL_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK="--quick"; shift ;;
        --model) MODEL_ARGS=(--model "$2"); shift 2 ;;
        *) echo "cuda_check: unknown argument '$1' (use --quick, --model DIR)" >&2; exit 2 ;;
    esac
done

banner() { printf '\n==== %s ====\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
    banner "setup: creating .venv (make setup)"
    make setup || { echo "cuda_check: make setup failed" >&2; exit 2; }
fi
PY=.venv/bin/python

banner "environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! "$PY" - <<'EOF'
import sys, torch
ok = torch.cuda.is_available()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); device: {torch.cuda.get_device_name() if ok else 'none'}"
      + (f", capability sm_{''.join(map(str, torch.cuda.get_device_capability()))}" if ok else ""))
import triton
print(f"triton {triton.__version__}")
sys.exit(0 if ok else 1)
EOF
then
    echo "cuda_check: no usable CUDA device from .venv's torch (a CPU-only torch build, or no GPU visible); nothing to check" >&2
    exit 2
fi

STATUS=0
mkdir -p reports

banner "conformance: deepinfer conformance --backend cuda --suite ops,e2e"
.venv/bin/deepinfer conformance --backend cuda --suite ops,e2e --report reports/cuda-conformance.json
CONF=$?
if [ $CONF -eq 0 ]; then CONF_MSG="PASS"; else CONF_MSG="FAIL (exit $CONF)"; STATUS=1; fi

banner "microbenchmark: Triton kernels vs the torch reference"
"$PY" benchmarks/cuda_kernels.py $QUICK
BENCH=$?
if [ $BENCH -eq 0 ]; then BENCH_MSG="ran"; else BENCH_MSG="ERROR (exit $BENCH)"; fi

banner "quantized ops: FP8 block GEMM and FP4 experts vs bf16"
"$PY" benchmarks/quantized_ops.py $QUICK
QUANT=$?
if [ $QUANT -eq 0 ]; then QUANT_MSG="ran"; else QUANT_MSG="ERROR (exit $QUANT)"; fi

banner "decode steps: CUDA graphs vs eager (step time, launches per step by layer type)"
"$PY" benchmarks/decode_steps.py --backend cuda --dtype bfloat16 ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --json
DECODE=$?
if [ $DECODE -eq 0 ]; then DECODE_MSG="ran"; else DECODE_MSG="ERROR (exit $DECODE)"; fi

banner "end to end: greedy generation, --backend cuda vs --backend cpu"
"$PY" benchmarks/backend_e2e.py --backend cuda ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"}
E2E=$?
if [ $E2E -eq 0 ]; then E2E_MSG="tokens match"; else E2E_MSG="FAIL (exit $E2E)"; STATUS=1; fi

banner "long context: prefill seconds per chunk and peak memory to 128K (1M without --quick), replay after a hit"
if [ -n "$QUICK" ]; then LC_CONTEXTS=8192,32768,131072; else LC_CONTEXTS=8192,32768,131072,524288,1048576; fi
"$PY" benchmarks/long_context.py --backend cuda --contexts "$LC_CONTEXTS" --replay-contexts 102400 --svg reports/long-context.svg --json
LONG=$?
if [ $LONG -eq 0 ]; then LONG_MSG="ran (plot: reports/long-context.svg)"; else LONG_MSG="ERROR (exit $LONG)"; fi

banner "summary"
echo "conformance:   $CONF_MSG   (report: reports/cuda-conformance.json)"
echo "benchmark:     $BENCH_MSG"
echo "quantized ops: $QUANT_MSG"
echo "decode steps:  $DECODE_MSG"
echo "end to end:    $E2E_MSG"
echo "long context:  $LONG_MSG"
exit $STATUS
