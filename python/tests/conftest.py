"""Shared helpers: every scenario that configures the library runs in its
own Python process (the library is configured once per process), so a
crash would show as a failed test, never take the test run down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parent.parent
REPO = PYTHON_DIR.parent


def wasmem_bin() -> Path | None:
    """The `wasmem` CLI of this checkout (or $WASMEM_BIN)."""
    given = os.environ.get("WASMEM_BIN")
    if given:
        return Path(given)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    p = target / "release" / "wasmem"
    return p if p.is_file() else None


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The package from this checkout when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR), env.get("PYTHONPATH", "")])
    for k in ("WASMEM_POLICY", "WASMEM_DEVICE", "WASMEM_SHADOW", "WASMEM_CTL", "WASMEM_TRACE_OUT", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def run_py(code: str, extra_env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter; fails the test on a non-zero exit."""
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env_for(extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p


def last_json(p: subprocess.CompletedProcess):
    """The JSON object on the last line of a process's standard output."""
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def have_torch():
    return pytest.importorskip("torch")
