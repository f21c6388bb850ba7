#!/usr/bin/env bash
# One device call's worth of GPU checks: the gpu tests, then the decode and prefill
# benchmarks, all logs and JSON under $OUT (or ./gpu_out); under 10 minutes. Run from the repository root:
#   bash benchmarks/gpu_session.sh            # everything (~5 minutes on an H200)
#   QUICK=1 bash benchmarks/gpu_session.sh    # tests + batch-1 bf16 decode only
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/device.txt"
timeout 260 python3 -m pytest -q tests/test_gpu_engine.py tests/test_kernels.py tests/test_prefill.py 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "^FAILED|passed|failed"
if [ -n "${QUICK:-}" ]; then
  timeout 120 python3 -m fastmamba.cli bench --models 130m,1.4b,2.8b --dtypes bfloat16 --batches 1 --json "$out/decode.json"
  exit 0
fi
timeout 220 python3 -m fastmamba.cli bench --hf --json "$out/decode.json" 2>&1 | grep -v transformers | tee "$out/decode.log"
timeout 100 python3 benchmarks/prefill.py --json "$out/prefill.json" 2>&1 | tee "$out/prefill.log"
timeout 90 python3 -m fastmamba.cli bench --deterministic --models 130m,2.8b --dtypes bfloat16 --batches 1,128 \
  --json "$out/decode_det.json" 2>&1 | tee "$out/decode_det.log"
