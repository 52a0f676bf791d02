#!/usr/bin/env bash
# Plan cache figures of traces: for each TRACE, `planned` cold (learns, writes a
# fresh cache), `planned` warm (reads it), `defrag` and `pytorch`, as a markdown row:
#   overhead, device allocs / frees, and plans loaded / hits / misses (planned runs).
# Usage: scripts/measure-plan-cache.sh TRACE...   (needs target/release/wasmem and python3)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WASMEM_BIN:-target/release/wasmem}
[ -x "$W" ] || { echo "build first: cargo build --release (no $W)" >&2; exit 2; }
[ $# -gt 0 ] || { echo "usage: $0 TRACE..." >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| trace | planned cold | planned warm | defrag | pytorch |"
echo "|---|---|---|---|---|"
for t in "$@"; do
    cache="$tmp/plans.json"
    rm -f "$cache"
    "$W" replay "$t" --policy planned --plan-cache "$cache" --json >"$tmp/cold.json"
    "$W" replay "$t" --policy planned --plan-cache "$cache" --json >"$tmp/warm.json"
    "$W" replay "$t" --policy defrag --json >"$tmp/defrag.json"
    "$W" replay "$t" --policy pytorch --json >"$tmp/pytorch.json"
    python3 - "$t" "$tmp" <<'PY'
import json, os, sys
t, d = sys.argv[1], sys.argv[2]
m = {k: json.load(open(os.path.join(d, k + ".json"))) for k in ("cold", "warm", "defrag", "pytorch")}
def planned(x):
    return "%.5f, %d / %d, %d / %d / %d" % (x["overhead_ratio"], x["device_alloc_calls"], x["device_free_calls"],
                                          x["plans_loaded"], x["plan_hits"], x["plan_misses"])
def other(x):
    return "%.4f, %d / %d" % (x["overhead_ratio"], x["device_alloc_calls"], x["device_free_calls"])
print("| %s | %s | %s | %s | %s |" % (os.path.basename(t), planned(m["cold"]), planned(m["warm"]), other(m["defrag"]), other(m["pytorch"])))
PY
done
