export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q tests/test_gpu_engine.py tests/test_kernels.py tests/test_prefill.py 2>&1 | tail -25 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
timeout 100 python3 benchmarks/prefill.py --json $OUT/prefill.json 2>&1 | tee $OUT/prefill.log
timeout 100 python3 -m fastmamba.cli bench --models 130m,2.8b --dtypes bfloat16 --batches 1,32,128 --json $OUT/decode.json 2>&1 | tail -8
timeout 150 python3 benchmarks/tune_scan.py 2>&1 | tee $OUT/tune_scan.txt
