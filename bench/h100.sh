#!/usr/bin/env bash
# The H100 runs behind bench/results/, one stage per device call (each must end inside 10 minutes):
#   bash bench/h100.sh grid fp16    # the timing grid of one dtype -> $OUT/h100_bench_fp16.csv
#   bash bench/h100.sh grid bf16
#   bash bench/h100.sh io           # ncu DRAM bytes -> $OUT/h100_io_ncu.csv (+ theory CSV)
# then, here: python -m attnzoo plot bench/results/h100_bench_*.csv --out-dir bench/results, and --readme-out.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attnzoo_out}
mkdir -p "$OUT"
IMPLS=${IMPLS:-triton_2kernel,triton_atomic,triton_atomic_recompute,sdpa_flash,sdpa_cudnn,flex_attention}
case "$1" in
grid)
    dtype=${2:-fp16}
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    # Compile every autotuning candidate on all cores first; the timed run then finds them in Triton's cache.
    python bench/precompile.py --dtype "$dtype" --d 64,128 --workers "${WORKERS:-14}" | tail -1
    python -m attnzoo bench --dtype "$dtype" --d 64,128 --N 1k,2k,4k,8k,16k --causal both --mode fwd,train \
        --impl "$IMPLS" --warmup 3 --repeat 10 --time-budget-s "${BUDGET:-520}" \
        --out "$OUT/h100_bench_$dtype.csv" 2>&1 | tee "$OUT/h100_bench_$dtype.log" | grep -v '^\[' ;;
io)
    python -m attnzoo io theory --N 512,1k,2k,4k,8k,16k --D 64,128 --B 1 --H "${H:-8}" --out "$OUT/h100_io_theory.csv"
    python -m attnzoo io measure --impl "${IO_IMPLS:-triton_2kernel,sdpa_math,sdpa_flash}" --N "${IO_N:-1k,4k,16k}" \
        --D 128 --B 1 --H "${H:-8}" --dtype fp16 --timeout-s 200 --time-budget-s "${IO_BUDGET:-480}" --out "$OUT/h100_io_ncu.csv" 2>&1 | tee "$OUT/h100_io.log" ;;
*)
    echo "usage: bash bench/h100.sh grid fp16|bf16 | io" >&2; exit 2 ;;
esac
