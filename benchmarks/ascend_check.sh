#!/usr/bin/env bash
# One command for a machine with Ascend NPUs (950, A3, A2): the environment as DeepInfer sees it
# (driver, CANN, torch / torch-npu / Triton-Ascend, SoC generation, what each op runs), conformance
# of the ascend backend (ops and e2e, with NPU graphs replayed against eager; collectives over HCCL
# when two or more NPUs are visible), decode steps with and without NPU graphs, and greedy
# generation on --backend ascend against --backend cpu.
#
#   benchmarks/ascend_check.sh [--quick] [--model DIR]
#
# Run it in a shell where CANN's set_env.sh has been sourced, in a Python environment with the
# torch-npu that pairs with the pinned torch (docs/ascend-bring-up.md, section 1). Writes
# reports/ascend-*.json. Exit status: 1 when conformance fails or the fp32 greedy tokens differ,
# 2 when no NPU or torch-npu is usable; benchmark numbers never fail it.
set -uo pipefail

cd "$(dirname "$0")/.."
QUICK=""
MODEL_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK="--reps 5"; shift ;;
        --model) MODEL_ARGS=(--model "$2"); shift 2 ;;
        *) echo "ascend_check: unknown argument '$1' (use --quick, --model DIR)" >&2; exit 2 ;;
    esac
done

banner() { printf '\n==== %s ====\n' "$*"; }

PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
DEEPINFER=("$PY" -m deepinfer.cli)

banner "environment"
command -v npu-smi >/dev/null && npu-smi info | head -20
for f in "${ASCEND_HOME_PATH:-/usr/local/Ascend/ascend-toolkit/latest}"/*/ascend_toolkit_install.info \
         "${ASCEND_HOME_PATH:-/usr/local/Ascend/ascend-toolkit/latest}"/version.cfg; do
    [ -f "$f" ] && { echo "CANN: $f"; grep -iE "version" "$f" | head -3; }
done
echo "HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-unset (200 MB default; the fused MoE dispatch sizes its own group)}"
NPUS=$("$PY" - <<'EOF'
import json, sys
from deepinfer.registry import list_backends
info = {b.name: b for b in list_backends()}
asc = info.get("ascend")
import importlib.metadata as md
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"
import torch
print(f"torch {torch.__version__}, torch-npu {version('torch-npu')}, triton-ascend {version('triton-ascend')}, "
      f"triton {version('triton')}", file=sys.stderr)
if asc is None or not asc.available:
    print(f"ascend backend unavailable: {asc.reason if asc else 'not installed'}", file=sys.stderr)
    print(0)
    sys.exit(0)
from deepinfer.registry import select_backend
selected = select_backend("ascend")
caps = selected.device.capabilities()
print(f"device: {selected.device.describe()}; generation {caps.extra.get('generation')}; dtypes "
      f"{[str(d).removeprefix('torch.') for d in caps.dtypes]}; graphs {caps.graph_capture}", file=sys.stderr)
paths = getattr(type(selected.kernels), "paths", None)
if paths is not None:
    print("kernel paths: " + ", ".join(f"{op}={where}" for op, where in sorted(paths().items())), file=sys.stderr)
print(selected.device.device_count())
EOF
)
if [ -z "$NPUS" ] || [ "$NPUS" -lt 1 ] 2>/dev/null; then
    echo "ascend_check: no usable NPU (see the reason above; docs/ascend-bring-up.md, section 1); nothing to check" >&2
    exit 2
fi

STATUS=0
mkdir -p reports

banner "conformance: deepinfer conformance --backend ascend --suite ops,e2e"
"${DEEPINFER[@]}" conformance --backend ascend --suite ops,e2e --report reports/ascend-conformance.json --junit reports/ascend-conformance.xml
CONF=$?
if [ $CONF -eq 0 ]; then CONF_MSG="PASS"; else CONF_MSG="FAIL (exit $CONF)"; STATUS=1; fi

COMM_MSG="skipped (one NPU visible)"
if [ "$NPUS" -ge 2 ]; then
    banner "conformance: collectives over HCCL (deepinfer conformance --backend ascend --suite comm)"
    "${DEEPINFER[@]}" conformance --backend ascend --suite comm --report reports/ascend-comm.json
    COMM=$?
    if [ $COMM -eq 0 ]; then COMM_MSG="PASS"; else COMM_MSG="FAIL (exit $COMM)"; STATUS=1; fi
fi

banner "decode steps: NPU graphs vs eager"
"$PY" benchmarks/decode_steps.py --backend ascend --dtype bfloat16 $QUICK ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --json
DECODE=$?
if [ $DECODE -eq 0 ]; then DECODE_MSG="ran"; else DECODE_MSG="ERROR (exit $DECODE)"; fi

banner "end to end: greedy generation, --backend ascend vs --backend cpu"
"$PY" benchmarks/backend_e2e.py --backend ascend ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"}
E2E=$?
if [ $E2E -eq 0 ]; then E2E_MSG="tokens match"; else E2E_MSG="FAIL (exit $E2E)"; STATUS=1; fi

banner "summary"
echo "conformance:   $CONF_MSG   (report: reports/ascend-conformance.json)"
echo "collectives:   $COMM_MSG"
echo "decode steps:  $DECODE_MSG"
echo "end to end:    $E2E_MSG"
exit $STATUS
