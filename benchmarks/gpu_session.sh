#!/usr/bin/env bash
# GPU checks in device calls of at most 10 minutes each, logs and JSON under $OUT (or
# ./gpu_out). Run from the repository root:
#   bash benchmarks/gpu_session.sh           # the GPU tests, then batch-1 bf16 decode (~4 minutes
#                                            # on a cold H200: compiling the kernels takes most of it)
#   SERVE=1 bash benchmarks/gpu_session.sh   # the engine's step ahead and the serving workload (~4 minutes)
#   BENCH=1 bash benchmarks/gpu_session.sh   # the benchmarks only: decode with HF, prefill,
#                                            # deterministic decode (~7 minutes)
#   HYBRID=1 bash benchmarks/gpu_session.sh  # Nemotron-H-8B's shape: decode (float32 and bf16 state),
#                                            # a 32k-token prompt, prefill, transformers; then served at
#                                            # 64 streams (~8 minutes)
#   SOAK=1 bash benchmarks/gpu_session.sh    # 8 minutes of the soak on the 2.8b shape (~9 minutes)
#   ONEROW=1 bash benchmarks/gpu_session.sh  # the hybrids' one-row step: its tests on the GPU, batch 1
#                                            # against the table's plan at four shapes (one with
#                                            # experts), Granite-Micro's kernels (~9 minutes)
#   DENSE=1 bash benchmarks/gpu_session.sh   # Nemotron-H-8B's batch 1 (the one-row step) beside batch
#                                            # 128 (the ratio), its 16k-token contexts and
#                                            # prefill 8 x 2048, Granite-4.0-H-Micro's and Falcon-H1-7B's
#                                            # batch 1, a profile of Nemotron's batch-128 step (~8 minutes)
#   SERVE_HYBRID=1 bash benchmarks/gpu_session.sh # Nemotron-H-8B served at 64 streams (the shared
#                                            # prefix's hits) (~5 minutes)
#   SHAPES=1 bash benchmarks/gpu_session.sh  # the other dense hybrid shapes: Granite-4.0-H-Micro and
#                                            # Falcon-H1-7B decode at batch 1, 32, 128, prefill and
#                                            # transformers beside (~6 minutes)
#   FALCON_FP8=1 bash benchmarks/gpu_session.sh # the GPU tests of the hybrids, the GPU engine and the FP8
#                                            # kernels, Falcon-H1-7B's batch 1, the 2.8b's prefill in bf16
#                                            # and fp8 (~7 minutes)
#   CONTEXTS=1 bash benchmarks/gpu_session.sh # Nemotron-H-8B's batch 128 with 16k-token contexts, then
#                                            # Granite-4.0-H-Micro and Falcon-H1-7B at batch 1 and 32 (~9 minutes)
#   FP8=1 bash benchmarks/gpu_session.sh     # bf16 beside fp8 at batch 1 and 128, 2.8b and Mamba-2 2.7b,
#                                            # the 2.8b's prefill 1 x 8192 in both and their profiles,
#                                            # then bf16's and FP8's routes at batch 64 and 128 (~8 minutes)
#   MOE=1 bash benchmarks/gpu_session.sh     # Granite-4.0-H-Tiny and Nemotron 3 Nano's shape at batch 1,
#                                            # 8, 64 and prefill 1 x 4096, Tiny's server at 64 streams,
#                                            # then the MoE tiles' sweep (~10 minutes)
#   WARM_START=1 bash benchmarks/gpu_session.sh # a server's start compiling what its requests meet: the
#                                            # samplers' and the engine's GPU tests, then Granite-4.0-H-Tiny
#                                            # served at 64 streams on this (cold) machine (~7 minutes)
#   MOE_ONE_ROW=1 bash benchmarks/gpu_session.sh # the one-row step's experts at batch 1: Granite-4.0-H-Tiny's
#                                            # with other moe_in / moe_out tiles, Nemotron 3 Nano's with the
#                                            # router's old settings, A B B A (~7 minutes)
#   BACKBONE=1 bash benchmarks/gpu_session.sh # the Mamba-2 Backbone's training beside cuDNN's LSTMs,
#                                            # both layers' training under bf16 autocast and in the
#                                            # deterministic mode, then both layers' steps (~8 minutes)
# The 20-minute soak spans three calls on one warm machine (each call at most 10 minutes; a
# process in its own session outlives the call that started it):
#   SOAK20=start bash benchmarks/gpu_session.sh  # starts it from a copy of this tree, runs every
#                                                # `gpu` test during its warm-up, waits (~10 minutes)
#   SOAK20=wait bash benchmarks/gpu_session.sh   # waits (~10 minutes), then again until it ends;
#                                                # once it has ended: the benchmarks that need the
#                                                # GPU alone (Nemotron-H-8B's decode at batch 1 and
#                                                # 128, and its server at 64 streams)
# (the server's packages as wheels: fastapi 0.165 needs opentelemetry-api beside it)
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
# (the commit: a snapshot's COMMIT file where the tree is a `git archive` copy)
cat COMMIT 2>/dev/null | tee -a "$out/device.txt" || git rev-parse --short HEAD 2>/dev/null | tee -a "$out/device.txt"
if [ -n "${SOAK20:-}" ]; then
  soak=/root/soak20
  started=$SECONDS
  if [ "$SOAK20" = start ]; then
    rm -rf "$soak" && mkdir -p "$soak/out" && cp -r fastmamba benchmarks pyproject.toml "$soak/"
    # (warm-up 6 minutes: the test suite below shares the GPU with the soak's start (its
    # checkpoint written, the server's graphs captured: ~1.5 minutes) and warm-up, and must
    # end inside them, so that the memory the soak judges is the server's alone; on an idle
    # H100 the suite took 250 s at eb7b86d, more now)
    # (SOAK20_ARGS: other soak arguments, e.g. "--cpu --model 130m --minutes 0.5 --warmup 0.1"
    # for a smoke run of this script without a GPU)
    (cd "$soak" && setsid python3 -m benchmarks.soak ${SOAK20_ARGS:---model 2.8b --minutes 20 --warmup 6} \
      --json "$soak/out/soak.json" > "$soak/out/soak.out" 2>&1 < /dev/null &)
    # (SOAK20_FIRST: test files not yet run on a GPU, run before the rest; -v logs each test as
    # it ends, so that a suite cut by its timeout still says which passed)
    first=${SOAK20_FIRST:-}
    rest=$(for f in $first; do echo "--ignore=$f"; done)
    for files in "$first" "tests/ $rest"; do
      [ "$files" = "" ] && continue
      PYTHONPATH=.:${PYTHONPATH:-} timeout $((420 - (SECONDS - started))) python3 -m pytest -v -rf -m gpu $files 2>&1 \
        | tee -a "$out/gpu_tests.log" | grep -E "^FAILED|passed|failed"
    done
  fi
  # (the call ends by 580 s; the soak's samples so far come back each time)
  while pgrep -f benchmarks.soak > /dev/null && [ $((SECONDS - started)) -lt 570 ]; do sleep 5; done
  cp "$soak"/out/* "$out"/ 2>/dev/null
  tail -5 "$soak/out/soak.out"
  if ! pgrep -f benchmarks.soak > /dev/null && [ "$SOAK20" = wait ] && [ $((SECONDS - started)) -lt 300 ]; then
    timeout 80 python3 -m benchmarks.hybrid --shape nemotron-h-8b --batches 1,128 --state-dtypes bfloat16 --long 0 \
      --prefills none --no-hf --json "$out/hybrid.json" 2>&1 | grep -v "transformers\]" | tee "$out/hybrid.log"
    timeout $((570 - (SECONDS - started))) python3 -m benchmarks.serve --model nemotron-h-8b --levels 64 \
      --json "$out/serve_hybrid.json" 2>&1 | grep -v Warning | tail -8 | tee "$out/serve_hybrid.log"
  fi
  exit 0
fi
if [ -n "${WARM_START:-}" ]; then  # (first on a fresh machine: the served level should compile nothing)
  PYTHONPATH=.:${PYTHONPATH:-} timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    tests/test_moe_kernel.py -k "sampl or gpu" 2>&1 | tee "$out/warm_start_tests.log" | grep -E "^FAILED|passed|failed"
  timeout $((590 - SECONDS)) python3 -m benchmarks.serve --model granite-4.0-h-tiny --levels 64 --json "$out/serve_tiny.json" 2>&1 \
    | grep -v Warning | tail -8 | tee "$out/serve_tiny.log"
  exit 0
fi
if [ -n "${MOE_ONE_ROW:-}" ]; then  # (the table's settings first in each round; Tiny's in_proj 8 x 256, out_proj 8 x 256)
  timeout 260 python3 -m benchmarks.hybrid --shape granite-4.0-h-tiny --batches 1 --plans one-row --rounds 2 --long 0 \
    --prefills none --no-hf --one-row-variant 'moe_in=(16, 256, 4)' --one-row-variant 'moe_in=(4, 256, 4)' \
    --one-row-variant 'moe_in=(8, 512, 4)' --one-row-variant 'moe_out=(16, 256, 4, 1280)' \
    --one-row-variant 'moe_out=(8, 512, 4, 1280)' --one-row-variant 'moe_out=(8, 256, 4, 2560)' \
    --json "$out/moe_one_row_tiny.json" 2>&1 | grep '"decode"' | tee "$out/moe_one_row.log"
  timeout $((580 - SECONDS)) python3 -m benchmarks.hybrid --shape nemotron-3-nano-30b-a3b --batches 1 --plans one-row \
    --rounds 2 --long 0 --prefills none --no-hf --one-row-variant 'router=(16, 512, 4, 1)' \
    --json "$out/moe_one_row_nano.json" 2>&1 | grep '"decode"' | tee -a "$out/moe_one_row.log"
  exit 0
fi
if [ -n "${BACKBONE:-}" ]; then
  timeout 200 python3 -m benchmarks.backbone --training --layer mamba2 --json "$out/backbone_train2.json" 2>&1 | grep -v Warn
  for layer in mamba1 mamba2; do  # bf16 autocast over float32 master weights, and the deterministic mode's cost
    timeout 100 python3 -m benchmarks.backbone --training --autocast --layer $layer \
      --json "$out/backbone_autocast_$layer.json" 2>&1 | grep -v Warn | grep forward_backward
    timeout 100 python3 -m benchmarks.backbone --training --deterministic --layer $layer \
      --json "$out/backbone_det_$layer.json" 2>&1 | grep -v Warn | grep forward_backward
  done
  for layer in mamba1 mamba2; do
    timeout 150 python3 -m benchmarks.backbone --step-only --layer $layer --json "$out/backbone_step_$layer.json" 2>&1 \
      | grep -v Warn
  done
  exit 0
fi
if [ -n "${FP8:-}" ]; then
  # the table (bf16 beside fp8 in one run); then which step an FP8 model's larger
  # batches should take (the plan's fp8 rows are 16-bit's, untuned)
  timeout 200 python3 -m fastmamba.cli bench --models 2.8b,mamba2-2.7b --dtypes bfloat16,fp8 --batches 1,128 \
    --json "$out/decode_fp8.json" 2>&1 | grep -v transformers | tee "$out/decode_fp8.log"
  # prefill 1 x 8192 in both, then where each one's time goes
  timeout 100 python3 -m benchmarks.prefill --models 2.8b --dtypes bfloat16,fp8 --shapes 1x8192 --long 0 \
    --json "$out/prefill_fp8.json" 2>&1 | grep -v Warn | tee "$out/prefill_fp8.log"
  for dtype in bfloat16 fp8; do
    timeout 60 python3 -m benchmarks.profile_prefill --model 2.8b --tokens 8192 --dtype $dtype --top 16 2>&1 \
      | grep -v Warn | tee "$out/profile_prefill_$dtype.log"
  done
  timeout $((570 - SECONDS)) python3 -m benchmarks.decode_routing --models 2.8b --dtypes bfloat16,fp8 --batches 64,128 \
    --candidates "Triton,Triton+cuBLAS,Triton+cuBLAS in/out" --json "$out/routing_fp8.json" 2>&1 | grep -v Warn | tee "$out/routing_fp8.log"
  exit 0
fi
if [ -n "${MOE:-}" ]; then  # (the issue's two shapes first, then the server, then the tiles' sweep)
  timeout 150 python3 -m benchmarks.hybrid --shape granite-4.0-h-tiny --batches 1,8,64 --long 0 --prefills 1x4096 \
    --no-hf --json "$out/hybrid_tiny.json" 2>&1 | grep -v "transformers\]" | tee -a "$out/hybrid.log"
  timeout 220 python3 -m benchmarks.hybrid --shape nemotron-3-nano-30b-a3b --batches 1,8,64 --long 0 --prefills 1x4096 \
    --no-hf --json "$out/hybrid_nano.json" 2>&1 | grep -v "transformers\]" | tee -a "$out/hybrid.log"
  # (the server and the offline engine each hold the model: Granite-4.0-H-Tiny's 14 GB, not Nemotron 3 Nano's 63)
  timeout $((500 - SECONDS)) python3 -m benchmarks.serve --model granite-4.0-h-tiny --levels 64 --json "$out/serve_tiny.json" 2>&1 \
    | grep -v Warning | tail -8 | tee "$out/serve_tiny.log"
  timeout $((590 - SECONDS)) python3 -m benchmarks.tune_moe 2>&1 | grep -v Warn | tee "$out/tune_moe.log"
  exit 0
fi
if [ -n "${FALCON_FP8:-}" ]; then
  # Falcon-H1's in_proj and q/k/v in one launch, and Mamba-1's FP8 in_proj written in
  # bfloat16: Falcon-H1-7B's batch 1, the GPU tests of the hybrids (the one-row step's too:
  # not `gpu`-marked, they run the kernels where CUDA is) and of the GPU engine, the FP8
  # kernels' tests, then the 2.8b's prefill (in that order, so that a call cut short still
  # brings back the step and the tests)
  timeout 80 python3 -m benchmarks.hybrid --shape falcon-h1-7b --batches 1 --state-dtypes bfloat16 --long 0 --prefills none \
    --no-hf --json "$out/hybrid_b1_falcon-h1-7b.json" 2>&1 | grep -v "transformers\]" | tee -a "$out/hybrid.log"
  PYTHONPATH=.:${PYTHONPATH:-} timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_hybrids.py \
    tests/test_gpu_engine.py -k "gpu or one_row or two_products" 2>&1 | tee "$out/falcon_fp8_hybrid_tests.log" \
    | grep -E "^FAILED|passed|failed"
  PYTHONPATH=.:${PYTHONPATH:-} timeout 150 python3 -m pytest -q -rf -p no:cacheprovider -m gpu tests/test_fp8_kernels.py 2>&1 \
    | tee "$out/falcon_fp8_fp8_tests.log" | grep -E "^FAILED|passed|failed"
  timeout $((570 - SECONDS)) python3 -m benchmarks.prefill --models 2.8b --dtypes bfloat16,fp8 --shapes 1x8192 \
    --json "$out/prefill_fp8.json" 2>&1 | grep -v Warn | tee "$out/prefill_fp8.log"
  exit 0
fi
if [ -n "${CONTEXTS:-}" ]; then  # 16k-token contexts (Nemotron-H-8B's batch 1 and 32: DENSE)
  # Nemotron-H-8B's batch 128 (2.1M tokens prefilled first, 256 steps of 8192)
  timeout 330 python3 -m benchmarks.hybrid --shape nemotron-h-8b --batches 128 --context 16384 \
    --state-dtypes bfloat16 --long 0 --prefills none --no-hf --json "$out/hybrid16k_b128.json" 2>&1 \
    | grep -v "transformers\]" | tee -a "$out/hybrid.log"
  n=2
  for shape in granite-4.0-h-micro falcon-h1-7b; do  # (what is left of the call, shared)
    timeout $(( (570 - SECONDS) / n )) python3 -m benchmarks.hybrid --shape $shape --batches 1,32 --context 16384 \
      --state-dtypes bfloat16 --long 0 --prefills none --no-hf --json "$out/hybrid16k_$shape.json" 2>&1 \
      | grep -v "transformers\]" | tee -a "$out/hybrid.log"
    n=$((n - 1))
  done
  exit 0
fi
if [ -n "${SHAPES:-}" ]; then
  for shape in granite-4.0-h-micro falcon-h1-7b; do  # (with prefill and transformers' generate at batch 1)
    timeout 170 python3 -m benchmarks.hybrid --shape $shape --batches 1,32,128 --state-dtypes bfloat16 --long 0 \
      --json "$out/hybrid_$shape.json" 2>&1 | grep -v "transformers\]" | tee -a "$out/hybrid.log"
  done
  exit 0
fi
if [ -z "${BENCH:-}${HYBRID:-}${DENSE:-}${SOAK:-}${SERVE:-}${SHAPES:-}${CONTEXTS:-}${SERVE_HYBRID:-}${FALCON_FP8:-}${BACKBONE:-}${MOE:-}${FP8:-}${ONEROW:-}${WARM_START:-}${MOE_ONE_ROW:-}" ]; then  # (no mode named: the default)
  # (the sm_90 compile test is for machines without a GPU: the CPU suite runs it)
  # every `gpu` test (~2 minutes on a warm H200; the server's tests need fastapi, uvicorn,
  # openai, pyzmq and msgspec: carry them as wheels, see the device tool's README)
  # (PYTHONPATH: this checkout's fastmamba for the subprocesses the tests start, where it is not installed)
  PYTHONPATH=.:${PYTHONPATH:-} timeout 420 python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log" | grep -E "^FAILED|passed|failed"
  timeout 120 python3 -m fastmamba.cli bench --models 130m,1.4b,2.8b --dtypes bfloat16 --batches 1 --json "$out/decode.json"
  exit 0
fi
if [ -n "${HYBRID:-}" ]; then
  timeout 300 python3 -m benchmarks.hybrid --shape nemotron-h-8b --state-dtypes float32,bfloat16 --json "$out/hybrid.json" \
    2>&1 | grep -v "transformers\]" | tee "$out/hybrid.log"
  timeout 200 python3 -m benchmarks.serve --model nemotron-h-8b --levels 64 --json "$out/serve_hybrid.json" 2>&1 \
    | grep -v Warning | tee "$out/serve_hybrid.log"
  exit 0
fi
if [ -n "${ONEROW:-}" ]; then
  # the hybrids' one-row step (kernels/decode_step_hybrid.py): its test on the GPU (not
  # `gpu`-marked: it runs the kernels where CUDA is), then batch 1 against the table's plan
  PYTHONPATH=.:${PYTHONPATH:-} timeout 180 python3 -m pytest -q -rf tests/test_hybrids.py tests/test_moe.py \
    -k "one_row_step or graphs_run_them" 2>&1 | tee "$out/onerow_tests.log" | grep -E "^FAILED|passed|failed"
  for shape in granite-4.0-h-micro nemotron-h-8b; do  # (where the one-row step stops winning)
    timeout 120 python3 -m benchmarks.hybrid --shape $shape --batches ${ONEROW_BATCHES:-1} --plans layer-ops,one-row \
      --state-dtypes bfloat16 \
      --long 0 --prefills none --no-hf --json "$out/onerow_$shape.json" 2>&1 | grep -v "transformers\]" | tee -a "$out/onerow.log"
  done
  if [ -z "${ONEROW_BATCHES:-}" ]; then
    timeout 60 python3 -m benchmarks.profile_step --model granite-4.0-h-micro --batch 1 --step one-row 2>&1 | grep -v Warn \
      | head -34 | tee -a "$out/profile_onerow.log"
  fi
  exit 0
fi
if [ -n "${DENSE:-}" ]; then
  # Nemotron-H-8B's batch 1 (the one-row step) beside batch 128 (the ratio), its
  # 16k-token contexts
  timeout 100 python3 -m benchmarks.hybrid --shape nemotron-h-8b --batches 1,128 --state-dtypes bfloat16 --long 0 \
    --prefills none --no-hf --json "$out/hybrid.json" 2>&1 | grep -v "transformers\]" | tee "$out/hybrid.log"
  timeout 130 python3 -m benchmarks.hybrid --shape nemotron-h-8b --batches 1,32 --context 16384 --state-dtypes bfloat16 \
    --long 0 --prefills 8x2048 --no-hf --json "$out/hybrid_16k.json" 2>&1 | grep -v "transformers\]" | tee -a "$out/hybrid.log"
  for shape in granite-4.0-h-micro falcon-h1-7b; do  # (batch 1 near the 0.80 target: 0.79-0.81 in two runs each)
    timeout 80 python3 -m benchmarks.hybrid --shape $shape --batches 1 --state-dtypes bfloat16 --long 0 --prefills none \
      --no-hf --json "$out/hybrid_b1_$shape.json" 2>&1 | grep -v "transformers\]" | tee -a "$out/hybrid.log"
  done
  # where the batch-128 step's time goes
  timeout 150 python3 -m benchmarks.profile_step --model nemotron-h-8b --batch 128 --state-dtype bfloat16 \
    2>&1 | grep -v Warn | head -34 | tee "$out/profile_b128.log"
  exit 0
fi
if [ -n "${SERVE_HYBRID:-}" ]; then  # (the prefix cache's default holds 16 of its 100 MB states: whether the shared 2048-token prefix hits)
  timeout 260 python3 -m benchmarks.serve --model nemotron-h-8b --levels 64 --json "$out/serve_hybrid.json" 2>&1 \
    | grep -v Warning | tee "$out/serve_hybrid.log" | tail -8
  exit 0
fi
if [ -n "${SOAK:-}" ]; then
  timeout 560 python3 -m benchmarks.soak --model 2.8b --minutes 8 --json "$out/soak.json" > "$out/soak.out" 2>&1
  tail -30 "$out/soak.out"
  exit 0
fi
if [ -n "${SERVE:-}" ]; then
  timeout 150 python3 -m benchmarks.engine_timeline --models 130m,2.8b --streams 1,64 --steps 20 --out "$out/timeline" \
    2>&1 | grep -v Warning
  timeout 260 python3 -m benchmarks.serve --model 2.8b --json "$out/serve.json" 2>&1 | grep -v Warning | tee "$out/serve.log"
  exit 0
fi
timeout 220 python3 -m fastmamba.cli bench --hf --json "$out/decode.json" 2>&1 | grep -v transformers | tee "$out/decode.log"
timeout 100 python3 -m benchmarks.prefill --json "$out/prefill.json" 2>&1 | tee "$out/prefill.log"
timeout 90 python3 -m fastmamba.cli bench --deterministic --models 130m,2.8b --dtypes bfloat16 --batches 1,128 \
  --json "$out/decode_det.json" 2>&1 | tee "$out/decode_det.log"
