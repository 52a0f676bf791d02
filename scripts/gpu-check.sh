#!/usr/bin/env bash
# GPU check for the wasmem CUDA backend (issue 8).
#
#   scripts/gpu-check.sh prepare        # on a build machine (no GPU needed):
#                                       #   build the GPU test binary, the benchmark and
#                                       #   libwasmem_capi.so, copy them, stripped, to target/gpu-check/
#   scripts/gpu-check.sh [run] [--quick]  # on the GPU machine, from the repo root:
#                                       #   use target/gpu-check/ if it is there (carry it),
#                                       #   else build with cargo (--offline), then
#                                       #   probe the device, run the GPU tests, run the benchmark,
#                                       #   run the PyTorch example (examples/pytorch) when
#                                       #   /opt/torch/.venv/bin/python3 (or $WASMEM_TORCH_PYTHON) exists,
#                                       #   run the NCCL check (one rank per GPU, all of them, through
#                                       #   the launcher environment and the TCP unique-id exchange),
#                                       #   run `wasmem train --device cuda` against the sim (equal losses),
#                                       #   the tiers on the GPU, and the Python package (python/: enable+track,
#                                       #   policies, shadow, ctl swap mid-run, memory_viz on its snapshot)
#
# Writes the benchmark table to stdout, and when $OUT is set:
#   $OUT/gpu-check.json  (the table as JSON; the PyTorch comparison under `pytorch_example`),
#   $OUT/gpu-tests.log, $OUT/gpu-bench.log, $OUT/pytorch.log, $OUT/pytorch/ (results, trace),
#   $OUT/nccl-rank<R>.log
#
# Exit status: 0 all passed; 1 a test, the benchmark or the PyTorch comparison failed; 2 nothing to run
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

# Builds the test binary, the examples and the C library; sets TEST_BIN, BENCH_BIN, NCCL_BIN and CAPI_LIB.
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
    say "building (cargo build --release -p wasmem --test cuda_device --example gpu_bench --example nccl_check --example tiers_gpu $*) ..."
    # shellcheck disable=SC2068
    if ! cargo build --release -p wasmem --test cuda_device --example gpu_bench --example nccl_check --example tiers_gpu $@ \
        --message-format=json-render-diagnostics >"$json"; then
        rm -f "$json"
        say "build failed"
        exit 2
    fi
    TEST_BIN=$(grep '"name":"cuda_device"' "$json" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    BENCH_BIN=$(grep '"name":"gpu_bench"' "$json" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    NCCL_BIN=$(grep '"name":"nccl_check"' "$json" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    TIERS_BIN=$(grep '"name":"tiers_gpu"' "$json" | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    say "building (cargo build --release -p wasmem-capi $*) ..."
    # shellcheck disable=SC2068
    if ! cargo build --release -p wasmem-capi $@ --message-format=json-render-diagnostics >"$json"; then
        rm -f "$json"
        say "build of wasmem-capi failed"
        exit 2
    fi
    CAPI_LIB=$(grep '"name":"wasmem_capi"' "$json" | grep -o '"[^"]*/libwasmem_capi\.so"' | tail -1 | tr -d '"')
    say "building (cargo build --release -p wasmem --bin wasmem $*) ..."
    # shellcheck disable=SC2068
    if ! cargo build --release -p wasmem --bin wasmem $@ --message-format=json-render-diagnostics >"$json"; then
        rm -f "$json"
        say "build of the wasmem CLI failed"
        exit 2
    fi
    WASMEM_BIN=$(grep '"name":"wasmem"' "$json" | grep '"kind":\["bin"\]' | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
    rm -f "$json"
    if [ ! -x "$TEST_BIN" ] || [ ! -x "$BENCH_BIN" ] || [ ! -f "$CAPI_LIB" ]; then
        say "build finished but the binaries were not found (test: '$TEST_BIN', bench: '$BENCH_BIN', lib: '$CAPI_LIB')"
        exit 2
    fi
    say "built in $(($(date +%s) - t0)) s"
}

if [ "$MODE" = prepare ]; then
    build
    rm -rf "$PREP"
    mkdir -p "$PREP"
    cp "$WASMEM_BIN" "$PREP/wasmem"
    cp "$TEST_BIN" "$PREP/cuda_device"
    cp "$BENCH_BIN" "$PREP/gpu_bench"
    cp "$NCCL_BIN" "$PREP/nccl_check"
    cp "$TIERS_BIN" "$PREP/tiers_gpu"
    cp "$CAPI_LIB" "$PREP/libwasmem_capi.so"
    if command -v strip >/dev/null 2>&1; then strip "$PREP/cuda_device" "$PREP/gpu_bench" "$PREP/nccl_check" "$PREP/tiers_gpu" "$PREP/wasmem" "$PREP/libwasmem_capi.so"; fi
    if command -v nm >/dev/null 2>&1; then
        say "libwasmem_capi.so exports: $(nm -D --defined-only "$PREP/libwasmem_capi.so" | awk '{print $NF}' | tr '\n' ' ')"
    fi
    {
        echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- host 2>/dev/null || echo ' (+ local changes)')"
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
        if command -v objdump >/dev/null 2>&1; then
            echo "needs glibc >= $(objdump -T "$PREP/gpu_bench" "$PREP/cuda_device" "$PREP/libwasmem_capi.so" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 | cut -d_ -f2)"
        fi
    } >"$PREP/BUILD_INFO"
    size_kib=$(du -sk "$PREP" | cut -f1)
    say "prepared $((size_kib / 1024)) MiB in target/gpu-check/ (the carry limit is 64 MiB in all):"
    if [ "$size_kib" -gt $((60 * 1024)) ]; then say "WARNING: target/gpu-check/ is close to or over the 64 MiB carry limit"; fi
    ls -l "$PREP"
    cat "$PREP/BUILD_INFO"
    say "on the GPU machine (carry target/gpu-check): bash scripts/gpu-check.sh"
    exit 0
fi

if [ "${WASMEM_GPU_CHECK_BUILD:-0}" != 1 ] && [ -x "$PREP/cuda_device" ] && [ -x "$PREP/gpu_bench" ]; then
    TEST_BIN="$PREP/cuda_device"
    BENCH_BIN="$PREP/gpu_bench"
    NCCL_BIN="$PREP/nccl_check"
    TIERS_BIN="$PREP/tiers_gpu"
    WASMEM_BIN="$PREP/wasmem"
    CAPI_LIB="$PREP/libwasmem_capi.so"
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

# 4. The PyTorch example: the same training with PyTorch's allocator and with
# libwasmem_capi.so, losses compared step for step (examples/pytorch/README.md).
TORCH_PY=${WASMEM_TORCH_PYTHON:-/opt/torch/.venv/bin/python3}
TORCH_OUT=${LOGDIR:+$LOGDIR/pytorch}
TORCH_OUT=${TORCH_OUT:-$(mktemp -d)}
torch_rc=0
if [ ! -x "$TORCH_PY" ]; then
    torch_status="skipped: no PyTorch Python at $TORCH_PY"
elif [ ! -f "${CAPI_LIB:-}" ]; then
    torch_status="skipped: libwasmem_capi.so not built (run 'scripts/gpu-check.sh prepare')"
else
    say "running the PyTorch example ($TORCH_PY examples/pytorch/train.py --compare)"
    mkdir -p "$TORCH_OUT"
    timeout 200 "$TORCH_PY" examples/pytorch/train.py --compare --lib "$CAPI_LIB" --out "$TORCH_OUT" 2>&1 | log pytorch.log
    torch_rc=$?
    case $torch_rc in
        0) torch_status="losses match" ;;
        1) torch_status="FAILED: the losses differ" ;;
        124) torch_status="FAILED: timed out" ;;
        *) torch_status="FAILED (rc $torch_rc)" ;;
    esac
fi
# 4b. The same with the `defrag` policy set (paged segments through the VMM API, stitching) and
# with `planned` (the planned arena: one device allocation, pointers stable for PyTorch).
for pol in defrag planned; do
    if [ "$torch_rc" = 0 ] && [ -x "$TORCH_PY" ] && [ -f "${CAPI_LIB:-}" ]; then
        say "running the PyTorch example with --policy $pol"
        mkdir -p "$TORCH_OUT/$pol"
        timeout 200 "$TORCH_PY" examples/pytorch/train.py --compare --policy $pol --lib "$CAPI_LIB" --out "$TORCH_OUT/$pol" 2>&1 | log pytorch-$pol.log
        torch_rc=$?
        case $torch_rc in
            0) torch_status="$torch_status; with $pol: losses match" ;;
            *) torch_status="$torch_status; with $pol: FAILED (rc $torch_rc)" ;;
        esac
    fi
done
# 4c. `planned` twice with a plan cache (WASMEM_PLAN_CACHE): the first run writes it, the second
# is served from planned offsets from its first allocation (its device calls: its arenas').
for pass in cold warm; do
    if [ "$torch_rc" = 0 ] && [ -x "$TORCH_PY" ] && [ -f "${CAPI_LIB:-}" ]; then
        say "running the PyTorch example with --policy planned and a plan cache ($pass)"
        mkdir -p "$TORCH_OUT/planned-cache-$pass"
        WASMEM_PLAN_CACHE="$TORCH_OUT/plans.json" timeout 200 "$TORCH_PY" examples/pytorch/train.py --compare \
            --policy planned --lib "$CAPI_LIB" --out "$TORCH_OUT/planned-cache-$pass" 2>&1 | log pytorch-planned-cache-$pass.log
        torch_rc=$?
        case $torch_rc in
            0) torch_status="$torch_status; planned with a plan cache ($pass): losses match" ;;
            *) torch_status="$torch_status; planned with a plan cache ($pass): FAILED (rc $torch_rc)" ;;
        esac
    fi
done
# 4d. `planned` planned ahead (--plan-ahead): the training recorded on the meta device first, so
# the first live run is served at planned offsets from its first allocation; its hits, misses and
# device calls (the wasmem run's wasmem_stats in wasmem.json) tell how well meta matches CUDA.
if [ "$torch_rc" = 0 ] && [ -x "$TORCH_PY" ] && [ -f "${CAPI_LIB:-}" ]; then
    say "running the PyTorch example with --policy planned --plan-ahead"
    mkdir -p "$TORCH_OUT/planned-ahead"
    timeout 200 "$TORCH_PY" examples/pytorch/train.py --compare --policy planned --plan-ahead "$TORCH_OUT/plans-ahead.json" \
        --lib "$CAPI_LIB" --out "$TORCH_OUT/planned-ahead" 2>&1 | log pytorch-planned-ahead.log
    torch_rc=$?
    ahead=$("${TORCH_PY}" -c 'import json,sys; s=json.load(open(sys.argv[1]))["wasmem_stats"]; print("hits %d, misses %d, device allocs %d" % (s["plan_hits"], s["plan_misses"], s["device_alloc_calls"]))' "$TORCH_OUT/planned-ahead/wasmem.json" 2>/dev/null || echo "no figures")
    case $torch_rc in
        0) torch_status="$torch_status; planned ahead: losses match ($ahead)" ;;
        *) torch_status="$torch_status; planned ahead: FAILED (rc $torch_rc)" ;;
    esac
fi
say "PyTorch example: $torch_status"
# Add the comparison to gpu-check.json (any Python will do).
MERGE_PY=$TORCH_PY
[ -x "$MERGE_PY" ] || MERGE_PY=$(command -v python3 || true)
if [ -n "$LOGDIR" ] && [ -n "$MERGE_PY" ] && [ -f "$LOGDIR/gpu-check.json" ]; then
    "$MERGE_PY" - "$LOGDIR/gpu-check.json" "$TORCH_OUT/summary.json" "$torch_status" "$torch_rc" <<'PY' || say "could not add the PyTorch result to gpu-check.json"
import json, os, sys
path, summary, status, rc = sys.argv[1:5]
with open(path) as f:
    report = json.load(f)
entry = {"status": status, "rc": int(rc)}
if os.path.isfile(summary):
    with open(summary) as f:
        entry["summary"] = json.load(f)
report["pytorch_example"] = entry
with open(path, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")
PY
fi

# 5. The NCCL communicator: one process per GPU (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), the unique id sent over TCP from rank 0, every
# collective checked. cudarc opens `libnccl.so` (not `libnccl.so.2`, the only
# name NVIDIA's pip wheel ships): link it from a private folder when needed.
nccl_rc=0
nccl_status=""
if [ ! -x "${NCCL_BIN:-}" ]; then
    nccl_status="skipped: nccl_check not built"
else
    NCCL_SO=$( (ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnccl\.so[.0-9]*$'; find /opt /usr/local /usr/lib /usr/lib64 -name 'libnccl.so*' 2>/dev/null) | head -1)
    if [ -n "$NCCL_SO" ]; then
        NCCL_LINKS=$(mktemp -d)
        ln -s "$NCCL_SO" "$NCCL_LINKS/libnccl.so"
        export LD_LIBRARY_PATH="$NCCL_LINKS:$(dirname "$NCCL_SO")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        say "NCCL library: $NCCL_SO"
    fi
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "${NGPU:-0}" -ge 1 ] || NGPU=1
    say "running the NCCL check on $NGPU rank(s), one per GPU"
    pids=()
    for ((r = 0; r < NGPU; r++)); do
        RANK=$r WORLD_SIZE=$NGPU LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
            timeout 120 "$NCCL_BIN" >"${LOGDIR:-/tmp}/nccl-rank$r.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || nccl_rc=$?; done
    cat "${LOGDIR:-/tmp}"/nccl-rank*.log
    case $nccl_rc in
        0) nccl_status="passed on $NGPU rank(s)$([ "$NGPU" -lt 2 ] && echo ' (one GPU: no two-rank all-gather possible)')" ;;
        3) nccl_status="skipped: no NCCL library (rc 3)"; nccl_rc=0 ;;
        *) nccl_status="FAILED (rc $nccl_rc)" ;;
    esac
fi
say "NCCL check: $nccl_status"

# 6. `wasmem train --device cuda`: ZeRO-0 and ZeRO-3 on 4 ranks with every tensor in GPU
# memory (compute on the CPU): the losses must equal the sim device's, bit for bit.
train_rc=0
if [ -x "${WASMEM_BIN:-}" ]; then
    TRAIN_OUT=${LOGDIR:+$LOGDIR/train}
    TRAIN_OUT=${TRAIN_OUT:-$(mktemp -d)}
    mkdir -p "$TRAIN_OUT"
    for z in 0 3; do
        for dev in cuda sim; do
            timeout 200 "$WASMEM_BIN" train --device $dev --ranks 4 --zero $z --policy defrag --steps 12 --json \
                >"$TRAIN_OUT/$dev-z$z.jsonl" 2>"$TRAIN_OUT/$dev-z$z.err" || train_rc=$?
        done
        if ! cmp -s <(grep -o '"loss":[^,]*' "$TRAIN_OUT/cuda-z$z.jsonl") <(grep -o '"loss":[^,]*' "$TRAIN_OUT/sim-z$z.jsonl") \
            || ! grep -q '"loss"' "$TRAIN_OUT/cuda-z$z.jsonl"; then
            say "train ZeRO-$z: the cuda losses differ from the sim losses (or none were printed)"
            train_rc=1
        fi
    done
    train_status=$([ $train_rc = 0 ] && echo "ZeRO-0 and ZeRO-3 on cuda: losses equal the sim's" || echo "FAILED (rc $train_rc; see train/*.err)")
else
    train_status="skipped: wasmem CLI not built"
fi
say "train on cuda: $train_status"

# 7. Tiers on the GPU: tensors evicted to pinned host memory and to spill files,
# brought back and compared byte for byte.
tiers_rc=0
if [ -x "${TIERS_BIN:-}" ]; then
    timeout 200 "$TIERS_BIN" 24 64 2>&1 | log tiers-gpu.log
    tiers_rc=${PIPESTATUS[0]}
    tiers_status=$([ $tiers_rc = 0 ] && echo "passed" || echo "FAILED (rc $tiers_rc)")
else
    tiers_status="skipped: tiers_gpu not built"
fi
say "tiers on cuda: $tiers_status"

# 8. The Python package (python/, wasmem.torch) on the GPU: enable + track in
# a real training run (the example's transformer, 24 steps) under several
# policies with a shadow, losses bitwise equal to PyTorch's allocator; peak
# reserved per policy; torch.cuda.memory_stats() (answered by wasmem) beside
# PyTorch's own; a `wasmem ctl swap` from another process mid-run; the
# snapshot opened by PyTorch's memory visualizer (torch.cuda._memory_viz).
# Figures: python/README.md ("GPU figures", not yet measured).
py_rc=0
py_status=""
if [ ! -x "$TORCH_PY" ] || [ ! -f "${CAPI_LIB:-}" ]; then
    py_status="skipped: no PyTorch Python or no libwasmem_capi.so"
else
    PY_OUT=${LOGDIR:+$LOGDIR/python}
    PY_OUT=${PY_OUT:-$(mktemp -d)}
    mkdir -p "$PY_OUT"
    for pol in lifecycle defrag pytorch; do
        say "python package: train.py --compare --policy $pol --shadow pytorch"
        timeout 240 "$TORCH_PY" examples/pytorch/train.py --compare --steps 24 --no-swap --policy "$pol" --shadow pytorch \
            --lib "$CAPI_LIB" --out "$PY_OUT/$pol" 2>&1 | log "python-$pol.log"
        rc=${PIPESTATUS[0]}
        [ "$rc" = 0 ] || { py_rc=1; py_status="$py_status $pol: FAILED (rc $rc);"; }
    done
    # The live control socket: a run that sleeps after each step, swapped from here.
    if [ -x "${WASMEM_BIN:-}" ]; then
        export XDG_RUNTIME_DIR="$PY_OUT/run"
        mkdir -p -m 700 "$XDG_RUNTIME_DIR"
        RANK=0 timeout 240 "$TORCH_PY" examples/pytorch/train.py --allocator wasmem --steps 24 --step-sleep 0.5 --ctl \
            --policy lifecycle --shadow pytorch --history 100000 --snapshot "$PY_OUT/snapshot.pickle" \
            --lib "$CAPI_LIB" --json "$PY_OUT/ctl-run.json" >"$PY_OUT/ctl-run.log" 2>&1 &
        run_pid=$!
        for _ in $(seq 1 120); do grep -q '^step   5' "$PY_OUT/ctl-run.log" 2>/dev/null && break; sleep 0.5; done
        "$WASMEM_BIN" ctl status 2>&1 | log python-ctl-status.log
        "$WASMEM_BIN" ctl swap all pytorch 2>&1 | log python-ctl-swap.log
        [ "${PIPESTATUS[0]}" = 0 ] || { py_rc=1; py_status="$py_status ctl swap: FAILED;"; }
        wait "$run_pid" || { py_rc=1; py_status="$py_status ctl run: FAILED;"; }
        unset XDG_RUNTIME_DIR
        "$TORCH_PY" - "$PY_OUT" <<'PY' 2>&1 | log python-figures.log || { py_rc=1; py_status="$py_status figures/memory_viz: FAILED;"; }
import json, os, pickle, sys
import torch.cuda._memory_viz as viz
out = sys.argv[1]
run = json.load(open(os.path.join(out, "ctl-run.json")))
assert run["wasmem_stats"]["policy"] == "pytorch", "the ctl swap reached the run: " + run["wasmem_stats"]["policy"]
for pol in ("lifecycle", "defrag", "pytorch"):
    s = json.load(open(os.path.join(out, pol, "summary.json")))
    ref = json.load(open(os.path.join(out, pol, "pytorch.json")))
    was = json.load(open(os.path.join(out, pol, "wasmem.json")))
    dev = was["wasmem_stats"]["devices"][0]
    print(f"{pol}: losses match {s['match']}; peak reserved pytorch {ref['peak_reserved_bytes']} wasmem {was['peak_reserved_bytes']}"
          f" shadow(pytorch) {dev['shadow']['metrics']['peak_reserved_bytes']}; peak allocated torch {ref['torch_stats']['allocated_bytes.all.peak']}"
          f" wasmem {was['torch_stats']['allocated_bytes.all.peak']}; retries/ooms {was['torch_stats']['num_alloc_retries']}/{was['torch_stats']['num_ooms']}")
    assert s["match"]
snap = pickle.load(open(os.path.join(out, "snapshot.pickle"), "rb"))
with open(os.path.join(out, "segments.svg"), "w") as f:
    f.write(viz.segment_plot(snap))
with open(os.path.join(out, "trace.html"), "w") as f:
    f.write(viz.trace_plot(snap))
print(f"snapshot: {len(snap['segments'])} segments, {len(snap['device_traces'][0])} trace entries; memory_viz rendered")
PY
    else
        py_status="$py_status ctl: skipped (wasmem CLI not built);"
    fi
    # The package's own tests (the CUDA-free parts; torch is preinstalled here).
    PYTHONPATH="$ROOT/python" WASMEM_CAPI_LIB="$CAPI_LIB" timeout 300 "$TORCH_PY" -m pytest -q python/tests 2>&1 | log python-tests.log
    [ "${PIPESTATUS[0]}" = 0 ] || [ "${PIPESTATUS[0]}" = 5 ] || { py_rc=1; py_status="$py_status pytest: FAILED;"; }
    [ $py_rc = 0 ] && py_status="passed (losses bitwise equal under lifecycle, defrag, pytorch; ctl swap mid-run; memory_viz)"
fi
say "python package: $py_status"

say "tests: $([ $tests_rc = 0 ] && echo passed || echo "FAILED (rc $tests_rc)"); benchmark: $([ $bench_rc = 0 ] && echo done || echo "FAILED (rc $bench_rc)"); PyTorch example: $torch_status; NCCL: $nccl_status; train: $train_status; tiers: $tiers_status; python: $py_status"
[ $tests_rc = 0 ] && [ $bench_rc = 0 ] && [ $torch_rc = 0 ] && [ $nccl_rc = 0 ] && [ $train_rc = 0 ] && [ $tiers_rc = 0 ] && [ $py_rc = 0 ] || exit 1
exit 0
