#!/usr/bin/env bash
# Builds the hostile policy corpus into tests/hostile/out/*.wasm (not committed).
# Rust crates → wasm32-wasip2 components; WAT components are compiled by the
# tests themselves with the `wat` crate.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export CARGO_TARGET_DIR="${HOSTILE_TARGET_DIR:-$here/target}"
cargo build --manifest-path "$here/Cargo.toml" --release --target wasm32-wasip2 --quiet
mkdir -p "$here/out"
for crate in hostile hostile_planner; do
  cp "$CARGO_TARGET_DIR/wasm32-wasip2/release/$crate.wasm" "$here/out/${crate//_/-}.wasm"
  echo "$here/out/${crate//_/-}.wasm"
done
