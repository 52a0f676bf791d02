#!/usr/bin/env bash
# GPU check for the wasmem CUDA backend (issue 8).
#
#   scripts/gpu-check.sh prepare        # on a build machine (no GPU needed):
#                                       #   build the GPU test binary and the benchmark,
#                                       #   copy them, stripped, to target/gpu-check/
#   scripts/gpu-check.sh [run] [--quick]  # on the GPU machine, from the repo root:
#                                       #   use target/gpu-check/ if it is there (carry it),
#                                       #   else build with cargo (--offline), then
#                                       #   probe the device, run the GPU tests, run the benchmark
#
# Writes the benchmark table to stdout, and when $OUT is set:
#   $OUT/gpu-check.json  (the table as JSON), $OUT/gpu-tests.log, $OUT/gpu-bench.log
#
# Exit status: 0 all passed; 1 a test or the benchmark failed; 2 nothing to run
# (no cargo and no prepared binaries, or the build failed); 3 no CUDA driver or GPU.
#
# Environment: WASMEM_GPU_CHECK_BUILD=1 builds even when target/gpu-check/ exists;
# CARGO_TARGET_DIR is honoured when building.

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
PREP="$ROOT/target/gpu-check"
MODE=run
QUICK=""
for arg in "$@"; do
    case "$arg" in
        prepare | run) MODE=$arg ;;
        --quick) QUICK=--quick ;;
        *)
            echo "usage: scripts/gpu-check.sh [prepare|run] [--quick]" >&2
            exit 2
            ;;
    esac
done

say() { echo "gpu-check: $*"; }

# Builds the test binary and the example; sets TEST_BIN and BENCH_BIN.
# $1: extra cargo flags (e.g. --offline).
build() {
    if ! command -v cargo >/dev/null 2>&1; then
        say "cargo not found on this machine, and no prepared binaries in target/gpu-check/."
        say "Run 'scripts/gpu-check.sh prepare' on a machine with the Rust toolchain and carry target/gpu-check/."
        exit 2
    fi
    local t0 json
    t0=$(date +%s)
    json=$(mktemp)
    say "building (cargo build --release -p wasmem --test cuda_device --example gpu_bench $*) ..."
    # shellcheck disable=SC2068
    if ! cargo build --release -p wasmem --test cuda_device --example gpu_bench $@ \
        --message-format=json-render-diagnostics >"$json"; then
        rm -f "$json"
        say "build failed"
        exit 2
    fi
    TEST_BIN=$(grep '"name":"cuda_device"' "$json" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    BENCH_BIN=$(grep '"name":"gpu_bench"' "$json" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    rm -f "$json"
    if [ ! -x "$TEST_BIN" ] || [ ! -x "$BENCH_BIN" ]; then
        say "build finished but the binaries were not found (test: '$TEST_BIN', bench: '$BENCH_BIN')"
        exit 2
    fi
    say "built in $(($(date +%s) - t0)) s"
}

if [ "$MODE" = prepare ]; then
    build
    mkdir -p "$PREP"
    cp "$TEST_BIN" "$PREP/cuda_device"
    cp "$BENCH_BIN" "$PREP/gpu_bench"
    if command -v strip >/dev/null 2>&1; then strip "$PREP/cuda_device" "$PREP/gpu_bench"; fi
    {
        echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- host 2>/dev/null || echo ' (+ local changes)')"
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
        if command -v objdump >/dev/null 2>&1; then
            echo "needs glibc >= $(objdump -T "$PREP/gpu_bench" "$PREP/cuda_device" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 | cut -d_ -f2)"
        fi
    } >"$PREP/BUILD_INFO"
    say "prepared $(du -sh "$PREP" | cut -f1) in target/gpu-check/:"
    ls -l "$PREP"
    cat "$PREP/BUILD_INFO"
    say "on the GPU machine (carry target/gpu-check): bash scripts/gpu-check.sh"
    exit 0
fi

if [ "${WASMEM_GPU_CHECK_BUILD:-0}" != 1 ] && [ -x "$PREP/cuda_device" ] && [ -x "$PREP/gpu_bench" ]; then
    TEST_BIN="$PREP/cuda_device"
    BENCH_BIN="$PREP/gpu_bench"
    say "using prepared binaries in target/gpu-check/ ($(tr '\n' ';' <"$PREP/BUILD_INFO" 2>/dev/null))"
else
    # GPU machines have no network: build from what is already cached.
    build --offline
fi

LOGDIR=${OUT:-}
if [ -n "$LOGDIR" ]; then mkdir -p "$LOGDIR"; fi
log() { if [ -n "$LOGDIR" ]; then tee "$LOGDIR/$1"; else cat; fi; }

# 1. Is there a GPU at all? (clean message, exit 3, when not)
if ! probe=$("$BENCH_BIN" --probe 2>&1); then
    say "$probe"
    say "no CUDA driver or no usable GPU on this machine: nothing to check"
    exit 3
fi
say "$probe"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader

# 2. The GPU tests (a missing GPU is a failure here).
say "running the GPU tests (WASMEM_GPU_TESTS=1)"
WASMEM_GPU_TESTS=1 timeout 240 "$TEST_BIN" --test-threads=1 2>&1 | log gpu-tests.log
tests_rc=$?

# 3. The benchmark (prints the table; writes $OUT/gpu-check.json).
say "running the benchmark"
timeout 240 "$BENCH_BIN" $QUICK 2>&1 | log gpu-bench.log
bench_rc=$?

say "tests: $([ $tests_rc = 0 ] && echo passed || echo "FAILED (rc $tests_rc)"); benchmark: $([ $bench_rc = 0 ] && echo done || echo "FAILED (rc $bench_rc)")"
[ $tests_rc = 0 ] && [ $bench_rc = 0 ] || exit 1
exit 0
