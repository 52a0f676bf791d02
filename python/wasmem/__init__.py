"""wasmem: a GPU memory manager for training whose decisions are made by
sandboxed WebAssembly (or built-in) policies.

- :mod:`wasmem.torch` — wasmem inside PyTorch: ``enable()`` installs it as
  the CUDA allocator, ``track()`` tags tensor kinds and training phases,
  PyTorch's memory APIs, live control, a shadow policy, and ``Recorder`` for
  traces recorded before a run (on the meta device, no GPU).
- :mod:`wasmem.capi` — the C ABI of ``libwasmem_capi.so`` through ctypes
  (no torch needed).
"""

from ._lib import KINDS, PHASES, Library, WasmemError, library, library_path
from .stats import torch_memory_stats

__all__ = ["KINDS", "PHASES", "Library", "WasmemError", "library", "library_path", "torch_memory_stats"]
__version__ = "0.1.0"
