#!/usr/bin/env bash
# Builds every policy in this folder into out/NAME.wasm:
#   Rust (cargo, wasm32-wasip2), Python (componentize-py), JavaScript (componentize-js).
# Installs what is missing from the registries: the wasm32-wasip2 Rust target
# (rustup), componentize-py (pip, into target/py-venv) and componentize-js
# (npm ci, into js/node_modules). Idempotent: an output newer than all of its
# inputs is kept, so a second run takes seconds. Any failure stops the script
# with a non-zero status; nothing is skipped.
#
# Usage: policies/build.sh            (from anywhere): every policy
#        policies/build.sh --rust     only the Rust policies (seconds, no Python/JS toolchains)
set -euo pipefail

rust_only=0
case "${1:-}" in
  "") ;;
  --rust) rust_only=1 ;;
  *) echo "build.sh: unknown argument \`$1\` (usage: build.sh [--rust])" >&2; exit 2 ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/out"
mkdir -p "$out"

COMPONENTIZE_PY_VERSION=0.25.1

# The Python and JavaScript decision policies stay on WIT 0.1.0 (the frozen
# copy in wit/compat/v0.1.0): they use no later item, and the engine loads
# every version, so policies/out keeps components of several versions. The
# Python planner needs 0.3.0 (the frozen copy in wit/compat/v0.3.0: it makes
# plain plans only, no `plan-aliased` of 0.4.0).
# name:python-module:world:WIT folder (relative to the repository root)
PYTHON_POLICIES=(
  "size-class:size_class:placement-policy:wit/compat/v0.1.0"
  "first-fit-planner:first_fit_planner:planner-policy:wit/compat/v0.3.0"
)
# name:source:world:WIT folder (relative to the repository root)
JS_POLICIES=("dtr-evict:dtr-evict.js:eviction-policy:wit/compat/v0.1.0")
# Rust crates (members of ./Cargo.toml) whose cdylib is a policy.
RUST_POLICIES=(pytorch-like lru-evict watermark-reclaim lifecycle defrag-reclaim greedy-planner)

step() { printf '==> %s\n' "$*"; }
need() { command -v "$1" >/dev/null || { echo "build.sh: \`$1\` is required: $2" >&2; exit 1; }; }
elapsed() { echo "$(($(date +%s) - $1)) s"; }

# True when $1 exists and is newer than every file under the other arguments.
up_to_date() {
  local target="$1"; shift
  [[ -e "$target" ]] || return 1
  [[ -z "$(find "$@" -type f -newer "$target" -not -path '*/node_modules/*' -not -path '*/__pycache__/*' -print -quit)" ]]
}

# --- Rust ------------------------------------------------------------------
need cargo "install Rust (rustup)"
if ! rustc --print target-libdir --target wasm32-wasip2 >/dev/null 2>&1 \
  || [[ ! -d "$(rustc --print target-libdir --target wasm32-wasip2)" ]]; then
  need rustup "the wasm32-wasip2 target is missing and rustup is needed to add it"
  step "rustup target add wasm32-wasip2"
  rustup target add wasm32-wasip2
fi
t0=$(date +%s)
step "Rust policies: cargo build --release --target wasm32-wasip2"
(cd "$here" && cargo build --release --target wasm32-wasip2 --locked \
  $(printf -- '-p %s ' "${RUST_POLICIES[@]}"))
for crate in "${RUST_POLICIES[@]}"; do
  built="$here/target/wasm32-wasip2/release/${crate//-/_}.wasm"
  [[ -f "$built" ]] || { echo "build.sh: cargo produced no $built" >&2; exit 1; }
  cmp -s "$built" "$out/$crate.wasm" || cp "$built" "$out/$crate.wasm"
  echo "    out/$crate.wasm ($(stat -c %s "$out/$crate.wasm") bytes)"
done
echo "    Rust: $(elapsed "$t0")"

if [[ "$rust_only" == 1 ]]; then
  step "Rust policies built in $out (--rust: Python and JavaScript skipped on request)"
  exit 0
fi

# --- Python ------------------------------------------------------------------
need python3 "Python 3.10 or newer builds the Python policies"
venv="$here/target/py-venv"
cpy="$venv/bin/componentize-py"
if [[ ! -x "$cpy" ]] || [[ "$("$cpy" --version 2>/dev/null)" != "componentize-py $COMPONENTIZE_PY_VERSION" ]]; then
  step "pip install componentize-py==$COMPONENTIZE_PY_VERSION (into target/py-venv)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION"
fi
for entry in "${PYTHON_POLICIES[@]}"; do
  IFS=: read -r name module world witdir <<<"$entry"
  target="$out/$name.wasm"
  witpath="$here/../$witdir"
  if up_to_date "$target" "$here/python" "$witpath" "$cpy"; then
    echo "    out/$name.wasm is up to date"
    continue
  fi
  t0=$(date +%s)
  step "Python policy $name: componentize-py -w $world componentize $module"
  (cd "$here/python" && "$cpy" -d "$witpath" -w "$world" componentize -p . "$module" -o "$target.tmp")
  mv "$target.tmp" "$target"
  echo "    out/$name.wasm ($(stat -c %s "$target") bytes, $(elapsed "$t0"))"
done

# --- JavaScript --------------------------------------------------------------
need node "Node.js 18 or newer builds the JavaScript policies"
need npm "npm installs componentize-js"
js="$here/js"
if ! up_to_date "$js/node_modules/.package-lock.json" "$js/package-lock.json"; then
  step "npm ci (componentize-js)"
  (cd "$js" && npm ci --no-audit --no-fund)
fi
for entry in "${JS_POLICIES[@]}"; do
  IFS=: read -r name source world witdir <<<"$entry"
  target="$out/$name.wasm"
  witpath="$here/../$witdir"
  if up_to_date "$target" "$js" "$witpath"; then
    echo "    out/$name.wasm is up to date"
    continue
  fi
  t0=$(date +%s)
  step "JavaScript policy $name: componentize-js, world $world"
  (cd "$js" && node build.mjs "$source" "$world" "$target.tmp" "$witpath")
  mv "$target.tmp" "$target"
  echo "    out/$name.wasm ($(stat -c %s "$target") bytes, $(elapsed "$t0"))"
done

step "all policies built in $out"
