#!/usr/bin/env bash
# The test command: builds the shipped policies (WebAssembly components, with
# the toolchains policies/build.sh installs when missing), runs the policies'
# own tests (Rust SDK and policies natively, Python, JavaScript), then every
# test of the engine workspace in one (release) profile, the Python package's
# tests, and the engine's tests without the `wasm` feature.
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
# The Python package (python/): installed into a virtual environment outside
# the clone ($WASMEM_PYENV, default ~/.cache/wasmem-pyenv: created when
# missing, reused when present) with the library built above, then its tests
# (those that need torch or transformers skip without them; .ci/run installs
# both).
PYENV="${WASMEM_PYENV:-$HOME/.cache/wasmem-pyenv}"
[ -x "$PYENV/bin/python" ] || python3 -m venv "$PYENV"
"$PYENV/bin/python" -m pip install --quiet pytest
WASMEM_CAPI_LIB="$PWD/target/release/libwasmem_capi.so" "$PYENV/bin/python" -m pip install --quiet ./python
"$PYENV/bin/python" -m pytest -q python/tests
# The engine, sessions, trainer, control and trace tools without the
# WebAssembly runtime (the `wasm` feature).
cargo test --release -p wasmem --no-default-features "$@"
