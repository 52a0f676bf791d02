#!/usr/bin/env bash
# Replay speed of two or more wasmem binaries on one trace and policy, alternating runs (the
# noise of runs of a few ms on a shared machine hits each binary alike): the median of 11
# runs' events/s per binary.
# Usage: scripts/ab-speed.sh TRACE POLICY BIN...   (needs python3)
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 TRACE POLICY BIN..." >&2; exit 2; }
t=$1; p=$2; shift 2
for _ in $(seq 1 11); do
    for b in "$@"; do
        echo "$b $("$b" replay "$t" --policy "$p" --json 2>/dev/null |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["events_per_second"] / 1e6)')"
    done
done | sort -k1,1 -k2n | awk '{v[$1] = v[$1] " " $2} END {for (b in v) {n = split(v[b], x, " "); printf "%s %.2f M events/s\n", b, x[int((n + 1) / 2)]}}'
