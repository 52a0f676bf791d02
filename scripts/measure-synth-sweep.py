#!/usr/bin/env python3
"""Memory figures of `planned` (cold and warm), `defrag` and `pytorch` on random
small and mid-size training configurations (`wasmem synth --preset tiny` with
drawn hidden size, layers, sequence, batch, vocabulary, optimizer, dtype,
checkpointing and 3-7 steps): the workloads beyond the shared traces.

Prints one markdown row per configuration (live peak; overhead and device
allocations of each run), then the geometric means of each overhead against
`pytorch`'s in the same configuration and how many runs are above it.

Usage: scripts/measure-synth-sweep.py [N] [SEED] [PLANNED]   (default 30
configurations, seed 7, PLANNED `planned`, e.g. `planned?effort=100`; needs
target/release/wasmem, or $WASMEM_BIN)
"""

import json
import math
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = os.environ.get("WASMEM_BIN", os.path.join(ROOT, "target", "release", "wasmem"))


def replay(trace, policy, cache=None):
    cmd = [W, "replay", trace, "--policy", policy, "--json"] + (["--plan-cache", cache] if cache else [])
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[0])


def config(rng):
    hidden = rng.randint(1, 8) * 64
    heads = hidden // 64
    return [
        "--hidden", str(hidden), "--heads", str(heads), "--kv-heads", str(heads),
        "--intermediate", str(4 * hidden), "--layers", str(rng.randint(1, 6)),
        "--seq", str(rng.randint(1, 4) * 64), "--batch", str(rng.randint(1, 4)),
        "--vocab", str(rng.randint(1, 5) * 2000), "--optimizer", rng.choice(["adamw", "sgd"]),
        "--checkpointing", rng.choice(["true", "false"]), "--dtype", rng.choice(["fp32", "bf16"]),
        "--steps", str(rng.randint(3, 7)),
    ]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 7)
    planned = sys.argv[3] if len(sys.argv) > 3 else "planned"
    if not os.access(W, os.X_OK):
        sys.exit(f"build first: cargo build --release (no {W})")
    runs = ("cold", "warm", "defrag", "pytorch")
    ratios = {k: [] for k in runs}
    print("| configuration | live MiB | planned cold | planned warm | defrag | pytorch |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            args = config(rng)
            trace, cache = os.path.join(tmp, f"c{i}.jsonl.gz"), os.path.join(tmp, f"c{i}.plans.json")
            subprocess.run([W, "synth", "--preset", "tiny", *args, "--output", trace], check=True, capture_output=True)
            m = {
                "cold": replay(trace, planned, cache),
                "warm": replay(trace, planned, cache),
                "defrag": replay(trace, "defrag"),
                "pytorch": replay(trace, "pytorch"),
            }
            for k in runs:
                ratios[k].append(m[k]["overhead_ratio"] / m["pytorch"]["overhead_ratio"])
            cells = " | ".join("%.4f, %d" % (m[k]["overhead_ratio"], m[k]["device_alloc_calls"]) for k in runs)
            o = dict(zip(args[::2], args[1::2]))
            label = "h{--hidden} l{--layers} s{--seq} b{--batch} v{--vocab} {--optimizer} {--dtype}".format_map(o) + (" ckpt" if o["--checkpointing"] == "true" else "") + f" {o['--steps']} steps"
            print("| %s | %.1f | %s |" % (label, m["pytorch"]["peak_live_bytes"] / 2**20, cells))
    print()
    for k in runs[:3]:
        r = ratios[k]
        geo = math.exp(sum(map(math.log, r)) / len(r))
        above = sum(x > 1.0001 for x in r)
        print(f"{k}: overhead / pytorch's, geometric mean {geo:.4f}, max {max(r):.4f}, above pytorch in {above} of {len(r)}")


if __name__ == "__main__":
    main()
