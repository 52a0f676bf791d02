#!/usr/bin/env bash
# The test command: builds the shipped policies (WebAssembly components, with
# the toolchains policies/build.sh installs when missing), runs the policies'
# own tests (Rust SDK and policies natively, Python, JavaScript), then every
# test of the engine workspace in one (release) profile, with and without the
# `wasm` feature.
set -euo pipefail
cd "$(dirname "$0")/.."
bash policies/build.sh
(cd policies && cargo test --quiet --locked)
(cd policies/python && python3 -m unittest --quiet)
(cd policies/js && npm test --silent)
# One build of every target (the same features as the test run, so nothing is
# compiled twice); it also produces libwasmem_capi.so, which `cargo test` alone
# does not (it builds that crate as an rlib), for the C ABI tests.
cargo build --release --workspace --all-targets
# The README's main command then compiles nothing new (host/hack pins the features).
bash scripts/check-one-build.sh
cargo test --release --workspace "$@"
# The engine, sessions, trainer, control and trace tools without the
# WebAssembly runtime (the `wasm` feature).
cargo test --release -p wasmem --no-default-features "$@"
