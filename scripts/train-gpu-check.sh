#!/usr/bin/env bash
# `wasmem train --device cuda` on a GPU machine: ZeRO-0 and ZeRO-3 on 4 ranks against the
# same runs on the sim device (the losses must be equal: compute is on the CPU, tensors live
# in the device's memory), and ZeRO-2 with CPU offload and a policy swap.
#
#   prepare (on a build machine): cargo build --release -p wasmem --bin wasmem &&
#       mkdir -p target/zero-gpu && strip -o target/zero-gpu/wasmem target/release/wasmem &&
#       cp scripts/train-gpu-check.sh target/zero-gpu/check.sh
#   run (on the GPU machine, carrying target/zero-gpu): OUT=dir bash target/zero-gpu/check.sh
#
# Results of an H200 run are in docs/measurements/train-h200/.
B=${WASMEM_BIN:-target/zero-gpu/wasmem}
OUT=${OUT:-.}
nvidia-smi -L
for z in 0 3; do
  timeout 200 $B train --device cuda --ranks 4 --zero $z --policy pytorch --steps 12 --json > $OUT/cuda-z$z.jsonl 2> $OUT/cuda-z$z.err; echo "cuda zero $z rc=$?"
  timeout 200 $B train --device sim --ranks 4 --zero $z --policy pytorch --steps 12 --json > $OUT/sim-z$z.jsonl 2> $OUT/sim-z$z.err; echo "sim zero $z rc=$?"
done
timeout 200 $B train --device cuda --ranks 4 --zero 2 --offload cpu --policy pytorch --steps 12 --swap-at 6:lifecycle > $OUT/cuda-z2-offload.txt 2>&1; echo "cuda zero 2 offload rc=$?"
tail -4 $OUT/cuda-z2-offload.txt
python3 - <<'PY'
import json, os
o = os.environ["OUT"]
for z in (0, 3):
    c = [json.loads(l) for l in open(f"{o}/cuda-z{z}.jsonl")]
    s = [json.loads(l) for l in open(f"{o}/sim-z{z}.jsonl")]
    lc = [x["loss"] for x in c if x.get("event") == "step"]
    ls = [x["loss"] for x in s if x.get("event") == "step"]
    print(f"zero {z}: cuda losses == sim losses: {lc == ls}; first/last {lc[0]:.4f}/{lc[-1]:.4f}")
    print("  cuda summary:", {k: c[-1][k] for k in ("model_state_bytes", "formula_bytes", "stage0_model_state_bytes", "phases")})
    print("  cuda rank0 last step:", c[-2]["ranks"][0])
PY
