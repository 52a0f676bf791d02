"""The C ABI of ``libwasmem_capi.so`` from Python, without torch: the same
functions PyTorch's pluggable allocator and :mod:`wasmem.torch` call. With
``WASMEM_DEVICE=sim`` (or ``init({"device": "sim"})``) every call runs on a
simulated device, which is how the package is tested without a GPU.
"""

from ._lib import KINDS, PHASES, Library, WasmemError, kind_code, kind_name, library, library_path

__all__ = ["KINDS", "PHASES", "Library", "WasmemError", "kind_code", "kind_name", "library", "library_path"]
