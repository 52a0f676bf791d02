#!/usr/bin/env bash
# The test command: builds the shipped policies (WebAssembly components), then
# runs every test of the workspace in one (release) profile.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x policies/build.sh ]; then
  bash policies/build.sh
fi
cargo test --release --workspace "$@"
