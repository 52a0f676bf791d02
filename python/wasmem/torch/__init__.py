"""wasmem inside PyTorch.

- :func:`enable` installs wasmem as the CUDA allocator of this process (one
  allocator per device), with a policy, an optional shadow policy and an
  optional control socket, and makes PyTorch's memory functions
  (``torch.cuda.memory_stats()``, ``memory_reserved()``, ``empty_cache()``,
  ``torch.cuda.memory._snapshot()`` …) answer from wasmem.
- :func:`track` tags tensor kinds and marks training phases from PyTorch's
  hooks, without changes to the model; :func:`kind` tags by hand.
- :func:`memory_stats` & co. answer with PyTorch's key names.
- :class:`Recorder` records a trace v1 before a run (``device="meta"``: no GPU).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import torch

from .._lib import KINDS, WasmemError, library
from ..stats import render, torch_memory_stats
from ._recorder import Recorder
from ._tags import Tracker, storages

__all__ = [
    "KINDS",
    "Recorder",
    "Tracker",
    "WasmemError",
    "empty_cache",
    "enable",
    "enabled",
    "kind",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "phase",
    "reset_peak_memory_stats",
    "snapshot",
    "dump_snapshot",
    "stats",
    "summary",
    "swap_policy",
    "track",
    "record_memory_history",
]

_LOCK = threading.Lock()
_ENABLED: dict[str, Any] | None = None
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def enabled() -> bool:
    """Whether :func:`enable` ran in this process."""
    return _ENABLED is not None


def _settings(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def enable(
    policy: str = "defrag",
    shadow: str | None = None,
    ctl: bool | str = False,
    *,
    trace: bool = False,
    trace_out: str | None = None,
    history: int = 0,
    patch_torch: bool = True,
    device: str = "cuda",
    sim_capacity: str | int | None = None,
    sim_devices: int | None = None,
    plan_cache: str | os.PathLike[str] | None = None,
) -> None:
    """Installs wasmem as PyTorch's CUDA allocator; call it once, before
    anything uses CUDA.

    - ``policy``: a policy spec (built-in ``naive``, ``pytorch``,
      ``lifecycle``, ``defrag`` …, a shipped policy name, a ``.wasm`` path,
      ``a+b``);
    - ``shadow``: a second policy run on the same events, bookkeeping only;
      its figures appear in :func:`memory_stats` (``wasmem.shadow.*``) and
      in ``wasmem ctl status``;
    - ``ctl``: serve the control socket (``True``: the default path, named
      by ``RANK``/``LOCAL_RANK``; a string: that path); ``WASMEM_CTL`` in
      the environment does the same;
    - ``trace`` / ``trace_out``: record a trace v1 (written at exit to
      ``trace_out``, or by :func:`dump_trace`);
    - ``history``: keep the last N allocator actions for :func:`snapshot`;
    - ``plan_cache``: with a planner (``policy="planned"``), read the plans
      of an earlier run of the same training from this file and keep this
      run's plans there, so that the next run is planned from its first
      step (``{rank}`` and ``{device}`` in the path are replaced, one file
      per process); ``WASMEM_PLAN_CACHE`` does the same;
    - ``patch_torch``: make ``torch.cuda``'s memory functions answer from wasmem;
    - ``device="sim"``: no GPU, nothing installed into PyTorch: the library
      runs on simulated devices (for tests of the bookkeeping).

    Raises :class:`WasmemError` when called twice, after CUDA was
    initialised, without a GPU, or when a setting (an unknown policy) is bad.
    """
    global _ENABLED
    with _LOCK:
        if _ENABLED is not None:
            raise WasmemError(
                f"wasmem.torch.enable() was already called in this process (policy {_ENABLED['policy']!r}); "
                "it installs the allocator once. To change the policy while running, call "
                "wasmem.torch.swap_policy(spec) or run `wasmem ctl swap all SPEC`"
            )
        if device not in ("cuda", "sim"):
            raise ValueError(f"enable(device={device!r}): the device is 'cuda' (a GPU) or 'sim' (simulated, tests)")
        if device == "cuda":
            if torch.cuda.is_initialized():
                raise WasmemError(
                    "wasmem.torch.enable() must run before CUDA is initialised, and CUDA already is in this "
                    "process (a tensor was put on a GPU, or a torch.cuda call initialised it), so PyTorch's own "
                    "allocator is in use and cannot be replaced. Fix: call wasmem.torch.enable() right after "
                    "`import torch`, before building the model or moving anything to the GPU"
                )
            if not torch.cuda.is_available():
                raise WasmemError(
                    "wasmem.torch.enable(): no CUDA device is available to this PyTorch "
                    f"(torch {torch.__version__}); to plan without a GPU, record a trace with "
                    "wasmem.torch.Recorder(device='meta') and replay it with `wasmem compare`"
                )
        lib = library()
        settings = _settings(
            policy=policy,
            shadow=shadow,
            device=device,
            sim_capacity=sim_capacity,
            sim_devices=sim_devices,
            trace=True if trace or trace_out else None,
            trace_out=os.fspath(trace_out) if trace_out else None,
            ctl=ctl if ctl else None,
            plan_cache=os.fspath(plan_cache) if plan_cache else None,
        )
        lib.init(settings)
        if device == "cuda":
            alloc = torch.cuda.memory.CUDAPluggableAllocator(lib.path, "wasmem_malloc", "wasmem_free")
            torch.cuda.memory.change_current_allocator(alloc)
        if history:
            lib.record_history(int(history))
        _ENABLED = {"policy": policy, "shadow": shadow, "device": device, "patched": False}
        if patch_torch:
            _patch_torch()
            _ENABLED["patched"] = True


def _lib_enabled():
    if _ENABLED is None:
        raise WasmemError("wasmem is not enabled in this process: call wasmem.torch.enable() first")
    return library()


def _device_index(device: Any = None) -> int:
    if device is None:
        if _ENABLED is not None and _ENABLED["device"] == "cuda" and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.index is not None:
        return d.index
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


# -- tagging --------------------------------------------------------------


class _LiveSink:
    """Tags for the live allocator: storages are pointers of wasmem."""

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def _ours(st: torch.UntypedStorage) -> bool:
        return st.device.type == "cuda" and st.data_ptr() != 0

    def keys(self, t: torch.Tensor) -> list[Any]:
        return [(st.device.index, st.data_ptr()) for st in storages(t) if self._ours(st)]

    def retag(self, t: torch.Tensor, kind: str) -> None:
        for st in storages(t):
            if self._ours(st):
                self.lib.retag(st.data_ptr(), st.device.index, kind)

    def phase(self, name: str, step: int) -> None:
        self.lib.phase(name, step)

    def set_default_kind(self, kind: str) -> None:
        self.lib.set_default_kind(kind)

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass


def track(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Tracker:
    """Tags kinds and marks phases of ``model`` (and ``optimizer``) for the
    live allocator: parameters and buffers ``param``, gradients ``grad``,
    optimizer states ``optim``, tensors saved for backward ``activation``,
    everything else ``temp``; phases forward / backward / optimizer /
    step_end with the step number. Returns the :class:`Tracker`
    (``.remove()`` takes its hooks off, ``.step`` is the step)."""
    return Tracker(_LiveSink(_lib_enabled()), model, optimizer)


@contextlib.contextmanager
def kind(name: str) -> Iterator[None]:
    """Allocations of this thread inside the block are of kind ``name``
    (``param``, ``grad``, ``optim``, ``activation``, ``temp``, ``other``),
    for the live allocator and for recorders."""
    lib = library()
    prev = lib.set_kind(name)
    try:
        yield
    finally:
        lib.set_kind(prev)


def phase(name: str, step: int) -> None:
    """Marks a phase by hand (``forward``, ``backward``, ``optimizer``, ``step_end``)."""
    _lib_enabled().phase(name, step)


# -- PyTorch's memory APIs --------------------------------------------------


def stats() -> dict[str, Any]:
    """wasmem's own statistics: every device, its shadow, the policy, the
    control socket."""
    return _lib_enabled().stats()


def memory_stats(device: Any = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats()`` from wasmem: PyTorch's keys
    (``allocated_bytes.all.current``, ``reserved_bytes.all.peak``,
    ``num_alloc_retries``, ``num_ooms`` …) plus ``wasmem.*`` (and
    ``wasmem.shadow.*`` with a shadow)."""
    return torch_memory_stats(stats(), _device_index(device))


def memory_allocated(device: Any = None) -> int:
    """Bytes in blocks handed out now."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` since the start or the last reset."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Any = None) -> int:
    """Bytes obtained from the device now."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Any = None) -> int:
    """Peak of :func:`memory_reserved` since the start or the last reset."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Peaks back to the current values."""
    _lib_enabled().reset_peaks(_device_index(device))


def empty_cache() -> int:
    """Releases the cached memory of every device through wasmem's
    reclamation path (whole free segments, free pages; no device-wide sync
    beyond the segment releases themselves); returns the bytes released."""
    return _lib_enabled().empty_cache(-1)


def record_memory_history(enabled: Any = "all", max_entries: int = 100000, **_ignored: Any) -> None:
    """``torch.cuda.memory._record_memory_history`` from wasmem: keeps the
    last ``max_entries`` allocator actions (``enabled=None``: stops). Stack
    traces are not recorded."""
    _lib_enabled().record_history(0 if enabled is None else int(max_entries))


def snapshot(device: Any = None) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()`` from wasmem: ``segments`` (each with
    its blocks) and ``device_traces`` (the recorded actions, see
    :func:`record_memory_history`), for PyTorch's memory visualizer."""
    return _lib_enabled().snapshot(_device_index(device))


def dump_snapshot(filename: str = "dump_snapshot.pickle", device: Any = None) -> None:
    """``torch.cuda.memory._dump_snapshot()`` from wasmem."""
    import pickle

    with open(filename, "wb") as f:
        pickle.dump(snapshot(device), f)


def dump_trace(path: str | None = None) -> None:
    """Writes the trace v1 recorded so far (``enable(trace=True)``)."""
    _lib_enabled().dump_trace(path)


def swap_policy(spec: str) -> None:
    """Swaps every device to the roles ``spec`` provides (as ``wasmem ctl swap``)."""
    _lib_enabled().swap_policy(spec)


def summary() -> str:
    """A short text of wasmem's figures, with the shadow's."""
    return render(stats())


# -- PyTorch's own functions answering from wasmem --------------------------


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in flat.items():
        cur = out
        parts = k.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
            if not isinstance(cur, dict):
                break
        else:
            cur[parts[-1]] = v
    return out


def _patch_torch() -> None:
    mem = torch.cuda.memory
    replacements = {
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": lambda device=None: _nested(memory_stats(device)),
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "empty_cache": lambda: (empty_cache(), None)[1],
        "_snapshot": lambda device=None, augment_with_fx_traces=False: snapshot(device),
        "_record_memory_history": record_memory_history,
    }
    for name, fn in replacements.items():
        for ns in (mem, torch.cuda):
            if hasattr(ns, name):
                _ORIGINALS.setdefault((ns, name), getattr(ns, name))
                setattr(ns, name, fn)


def _unpatch_torch() -> None:
    for (ns, name), fn in _ORIGINALS.items():
        setattr(ns, name, fn)
    _ORIGINALS.clear()
