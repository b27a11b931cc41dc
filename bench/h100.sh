#!/usr/bin/env bash
# The H100 runs behind bench/results/, one stage per device call (each must end inside 10 minutes):
#   bash bench/h100.sh grid fp16 64    # the timing grid of one dtype and head dim -> $OUT/h100_bench_fp16_d64.csv
#   bash bench/h100.sh grid fp16 128   # (one head dim per call leaves time to re-measure inconsistent shapes)
#   bash bench/h100.sh grid bf16 64 ...
#   bash bench/h100.sh shipped fp16 128  # the same grid on the shipped table, no tuning -> $OUT/h100_grid_fp16_d128.csv
#   bash bench/h100.sh io              # ncu DRAM bytes -> $OUT/h100_io_ncu.csv (+ theory CSV)
#   bash bench/h100.sh decode          # the decoding benchmark, eager calls and CUDA-graph replays -> $OUT/h100_decode.*
#   bash bench/h100.sh varlen          # packed batches against dense, Flex and padded SDPA -> $OUT/h100_varlen.*
#   bash bench/h100.sh tests dense     # the -m gpu suite in parts that end inside 10 minutes: dense, modifiers,
#                                      # features (KV cache, varlen, ring, compile, interface) and big (> 2^31 elements,
#                                      # about 50 GB of GPU memory, so alone) -> $OUT/gpu_<part>.log
# then, here: copy the parts into bench/results, `bash bench/h100.sh merge fp16` (one CSV and log per dtype),
# python -m attnzoo plot bench/results/h100_bench_*.csv --out-dir bench/results, and --readme-out.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attnzoo_out}
mkdir -p "$OUT"
IMPLS=${IMPLS:-triton_2kernel,triton_atomic,triton_atomic:delta=recompute,sdpa_flash,sdpa_cudnn,flex_attention}
case "$1" in
grid)
    dtype=${2:-fp16}
    dims=${3:-64,128}
    name=h100_bench_$dtype${3:+_d$3}
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    # Compile every autotuning candidate on all cores first; the timed run then finds them in Triton's cache.
    python -m attnzoo tune --compile-only --quiet --dtype "$dtype" --d "$dims" --workers "${WORKERS:-14}"
    python -m attnzoo bench --autotune --dtype "$dtype" --d "$dims" --N 1k,2k,4k,8k,16k --causal both --mode fwd,train \
        --impl "$IMPLS" --warmup 3 --repeat 10 --time-budget-s "${BUDGET:-480}" --recheck "${RECHECK:-1.15}" \
        --out "$OUT/$name.csv" 2>&1 | tee "$OUT/$name.log" | grep -v '^\[' ;;
shipped)
    # The grid on the shipped table as a first call finds it (no tuning in the run), one dtype and head dim per call:
    # -> $OUT/h100_grid_<dtype>_d<D>.csv; bench/results/h100_grid_shipped_<dtype>.csv joins a dtype's parts.
    dtype=${2:-fp16}
    d=${3:-128}
    name=h100_grid_${dtype}_d$d
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    python -m attnzoo bench --dtype "$dtype" --d "$d" --N 1k,2k,4k,8k,16k --causal both --mode fwd,train \
        --impl "${SHIPPED_IMPLS:-triton_2kernel,triton_atomic,sdpa_flash,sdpa_cudnn,flex_attention}" --warmup 3 \
        --repeat 10 --time-budget-s "${BUDGET:-240}" --recheck "${RECHECK:-1.15}" \
        --out "$OUT/$name.csv" 2>&1 | tee "$OUT/$name.log" | grep -v '^\[' ;;
merge)
    # The per-head-dim parts of one dtype (in bench/results) -> one CSV (header once) and one log.
    dtype=${2:-fp16}
    mapfile -t parts < <(printf '%s\n' bench/results/h100_bench_"$dtype"_d*.csv | sort -V)  # D ascending
    { head -n 1 "${parts[0]}"; for part in "${parts[@]}"; do tail -n +2 "$part"; done; } > "bench/results/h100_bench_$dtype.csv"
    for part in "${parts[@]}"; do cat "${part%.csv}.log"; done > "bench/results/h100_bench_$dtype.log"
    rm "${parts[@]}" bench/results/h100_bench_"$dtype"_d*.log ;;
io)
    python -m attnzoo io theory --N 512,1k,2k,4k,8k,16k --D 64,128 --B 1 --H "${H:-8}" --out "$OUT/h100_io_theory.csv"
    python -m attnzoo io measure --impl "${IO_IMPLS:-triton_2kernel,sdpa_math,sdpa_flash}" --N "${IO_N:-1k,4k,16k}" \
        --D 128 --B 1 --H "${H:-8}" --dtype fp16 --timeout-s 200 --time-budget-s "${IO_BUDGET:-480}" --out "$OUT/h100_io_ncu.csv" 2>&1 | tee "$OUT/h100_io.log" ;;
decode)
    timeout "${BENCH_TIMEOUT_S:-540}" python -m attnzoo.bench.decode --Nq ${NQ:-1 4} --out "$OUT/h100_decode.csv" \
        --budget-s "${BUDGET:-420}" > "$OUT/h100_decode.log" 2>&1
    python -m attnzoo.bench.decode --plot "$OUT/h100_decode.csv"
    grep -E "triton_splitk +(eager|graph)" "$OUT/h100_decode.log" | tail -40 ;;
varlen)
    timeout "${BENCH_TIMEOUT_S:-300}" python -m attnzoo.bench.varlen --d 64,128 --dtype bf16 \
        --out "$OUT/h100_varlen.csv" --plot "$OUT/h100_varlen.png" > "$OUT/h100_varlen.log" 2>&1
    tail -6 "$OUT/h100_varlen.log" ;;
tests)
    part=${2:-dense}
    workers=${XDIST:-6}
    case "$part" in
    dense) targets=(tests/test_gpu.py --deselect tests/test_gpu.py::test_more_than_2_31_elements) ;;
    modifiers) targets=(tests/test_gpu_score_modifiers.py) ;;
    features) targets=(tests/test_gpu_kvcache.py tests/test_gpu_varlen.py tests/test_distributed.py
                       tests/test_gpu_compile.py tests/test_gpu_interface.py) ;;
    big) targets=(tests/test_gpu.py::test_more_than_2_31_elements); workers=0 ;;
    *) echo "usage: bash bench/h100.sh tests dense|modifiers|features|big" >&2; exit 2 ;;
    esac
    # -v writes each result as it comes, so a part cut by its time limit still names what passed and failed.
    timeout "${TEST_TIMEOUT_S:-540}" python -m pytest -m gpu -v -n "$workers" --tb=short -p no:cacheprovider \
        -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning "${targets[@]}" > "$OUT/gpu_$part.log" 2>&1
    echo "gpu tests, $part: $(grep -c ' PASSED' "$OUT/gpu_$part.log") passed, $(grep -c ' FAILED' "$OUT/gpu_$part.log") failed"
    grep -E ' FAILED|^E ' "$OUT/gpu_$part.log" | head -20 ;;
*)
    echo "usage: bash bench/h100.sh grid fp16|bf16 [D] | shipped fp16|bf16 [D] | merge fp16|bf16 | io | decode | varlen | tests dense|modifiers|features|big" >&2
    exit 2 ;;
esac
