export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q tests/test_gpu_engine.py tests/test_kernels.py tests/test_prefill.py 2>&1 | tail -25 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
timeout 100 python3 -m fastmamba.cli bench --models 130m,1.4b,2.8b --dtypes bfloat16 --batches 1 --json $OUT/decode.json 2>&1 | tail -4
for a in "130m 1" "2.8b 1" "2.8b 128"; do set -- $a; timeout 60 python3 benchmarks/profile_step.py --model $1 --batch $2 2>&1 | grep -v Warn | cut -c1-52,120-190 | tee -a $OUT/profile_step.txt | head -22; done
