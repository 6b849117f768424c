export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
ncu --version | tail -1
timeout 200 ncu --section WarpStateStats --section SourceCounters --section InstructionStats -k regex:kernel_fp8 --launch-count 1 -f -o /tmp/fp8rep python3 benchmarks/bench_fp8_block_gemm.py --shapes moe8 --iters 1 --out /tmp/x.json > $OUT/ncu_run.log 2>&1; echo rc=$?
ncu -i /tmp/fp8rep.ncu-rep --page source --print-source sass --csv > $OUT/src.csv 2> $OUT/src.err; echo rc=$? ; wc -l $OUT/src.csv; head -3 $OUT/src.csv | cut -c1-600
ncu -i /tmp/fp8rep.ncu-rep --page details --print-details all > $OUT/details.txt 2>&1; grep -i -A40 "Warp State" $OUT/details.txt | head -60
