"""Builds ``libwasmem_capi.so`` with cargo and puts it inside the package.

A plain Python package that loads the cdylib through ctypes (no maturin):
``pip install ./python`` from a wasmem checkout runs
``cargo build --release -p wasmem-capi`` in the checkout (a no-op when it is
up to date) and copies the library into ``wasmem/``. ``WASMEM_CAPI_LIB`` names
a library built elsewhere instead (then cargo is not run).
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LIB = "libwasmem_capi.so"


def built_library() -> Path:
    given = os.environ.get("WASMEM_CAPI_LIB")
    if given:
        p = Path(given)
        if not p.is_file():
            raise SystemExit(f"WASMEM_CAPI_LIB={given}: no such file")
        return p
    if not (REPO / "Cargo.toml").is_file():
        raise SystemExit(
            f"{REPO} is not a wasmem checkout: install from the checkout (`pip install ./python`), "
            "or set WASMEM_CAPI_LIB to a built libwasmem_capi.so"
        )
    cargo = shutil.which("cargo")
    if cargo is None:
        raise SystemExit("cargo is not on PATH: install Rust (rustup) to build libwasmem_capi.so")
    subprocess.run([cargo, "build", "--release", "-p", "wasmem-capi"], cwd=REPO, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target.is_absolute():
        target = REPO / target
    lib = target / "release" / LIB
    if not lib.is_file():
        raise SystemExit(f"cargo built, but {lib} is missing")
    return lib


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "wasmem" / LIB
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built_library(), dest)


class BinaryDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
