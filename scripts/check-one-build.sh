#!/usr/bin/env bash
# Checks that the README's two commands share one build: after the test
# build (`cargo build --release --workspace --all-targets`, run by
# scripts/test.sh before this), building what the main command runs
# (`cargo run --release -- …` builds the `wasmem` binary) compiles nothing.
# A crate compiled here means a dependency's features differ between the two
# builds: add them to host/hack/Cargo.toml (the workspace hack).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(cargo build --release -p wasmem --bin wasmem 2>&1)"
if grep -q "Compiling" <<<"$out"; then
  echo "check-one-build: the main command's build compiles crates the test build already built:" >&2
  grep "Compiling" <<<"$out" >&2
  exit 1
fi
echo "check-one-build: the main command's build is fresh after the test build"
