"""``Recorder``: a trace v1 recorded from the tensors PyTorch creates, not
from an allocator, so it works on the meta device (nothing is allocated, no
GPU needed) as well as on ``cuda`` or ``cpu``.

A ``TorchDispatchMode`` sees every operator's outputs; each storage of the
recorded device seen for the first time is an ``alloc`` of its size (the
bytes PyTorch would request), and a weak reference on it records the
``free`` when PyTorch releases it. Kinds and phases come from a
:class:`~wasmem.torch._tags.Tracker` (``rec.track(model, opt)``) and from
``wasmem.torch.kind``; the trace is written by the engine's own writer.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._lib import WasmemError, library
from ._tags import Tracker, storages


class _Mode(TorchDispatchMode):
    def __init__(self, rec: "Recorder"):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self.rec._see(t)
        return out


class Recorder:
    """Records a trace v1 of the tensors created on ``device`` while it is
    entered (``with Recorder(device="meta") as rec: ...``).

    - ``rec.track(model, optimizer)`` tags kinds and phases (as
      :func:`wasmem.torch.track` does for the live allocator);
    - ``rec.save("t.jsonl.gz")`` writes the trace so far (also after an
      exception inside the block: the exception propagates, the trace stays);
    - ``rec.stats()`` gives its counts (``peak_live_bytes`` …).

    On the meta device the default device is ``meta`` inside the block
    (factory calls without a device create meta tensors), except during an
    optimizer step of a tracked optimizer (its scalar ``step`` counters live
    on the CPU, as PyTorch puts them).
    """

    def __init__(self, device: str | torch.device = "meta", source: str | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.source = source or f"wasmem.torch.Recorder on {self.device}"
        self._lib = library()
        self._h: int | None = None
        self._ids: dict[int, tuple[int, Any]] = {}
        self._mode: _Mode | None = None
        self._prev_default: torch.device | None = None
        self._trackers: list[Tracker] = []
        self._closed = False

    # -- entering and leaving ---------------------------------------------
    def __enter__(self) -> "Recorder":
        if self._h is not None:
            raise WasmemError("this Recorder is already recording (enter it once)")
        if self._closed:
            raise WasmemError("this Recorder was closed; make a new one")
        self._h = self._lib.recorder_open(self.source)
        self._mode = _Mode(self)
        self._mode.__enter__()
        if self.device.type == "meta":
            self._prev_default = torch.get_default_device()
            torch.set_default_device("meta")
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._mode is not None:
            self._mode.__exit__(exc_type, exc, tb)
            self._mode = None
        if self._prev_default is not None:
            torch.set_default_device(self._prev_default)
            self._prev_default = None
        for t in self._trackers:
            t.remove()
        return False

    # -- what the dispatch mode sees --------------------------------------
    def _matches(self, st: torch.UntypedStorage) -> bool:
        d = st.device
        return d.type == self.device.type and (self.device.index is None or d.index == self.device.index)

    def _see(self, t: torch.Tensor) -> None:
        if self._h is None:
            return
        for st in storages(t):
            if not self._matches(st):
                continue
            key = self._key(st)
            if key in self._ids:
                continue
            n = st.nbytes()
            if n == 0:
                continue
            ident = self._lib.recorder_alloc(self._h, n, None)
            h = self._h
            lib = self._lib
            ids = self._ids

            def freed(_ref: Any, key: int = key, ident: int = ident) -> None:
                ids.pop(key, None)
                try:
                    lib.recorder_free(h, ident)
                except WasmemError:
                    pass  # the recorder was closed meanwhile

            self._ids[key] = (ident, weakref.ref(st, freed))

    @staticmethod
    def _key(st: torch.UntypedStorage) -> int:
        # The storage's C++ identity: stable while it lives (also on the meta
        # device, where every data pointer is 0).
        return st._cdata

    # -- the sink a Tracker tags through ----------------------------------
    def keys(self, t: torch.Tensor) -> list[Any]:
        """Identities of the recorded storages of ``t``."""
        return [self._key(st) for st in storages(t) if self._matches(st)]

    def retag(self, t: torch.Tensor, kind: str) -> None:
        """Gives the recorded storages of ``t`` the kind ``kind``."""
        if self._h is None:
            return
        for st in storages(t):
            if not self._matches(st):
                continue
            if self._key(st) not in self._ids:
                self._see_storage_of(t)
            entry = self._ids.get(self._key(st))
            if entry is not None:
                self._lib.recorder_retag(self._h, entry[0], kind)

    def _see_storage_of(self, t: torch.Tensor) -> None:
        # A tensor created before the recorder started (or outside the
        # dispatch mode) is recorded when it is first tagged.
        self._see(t)

    def phase(self, name: str, step: int) -> None:
        """Records a phase mark."""
        if self._h is not None:
            self._lib.recorder_phase(self._h, name, step)

    def set_default_kind(self, kind: str) -> None:
        """The kind of untagged storages from now on."""
        self._lib.set_default_kind(kind)

    def before_step(self) -> None:
        """An optimizer step begins: its scalar state goes to the CPU."""
        if self._prev_default is not None:
            torch.set_default_device(self._prev_default)

    def after_step(self) -> None:
        """An optimizer step ended."""
        if self._prev_default is not None:
            torch.set_default_device("meta")

    # -- the user's side ---------------------------------------------------
    def track(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Tracker:
        """Tags kinds and phases of ``model`` and ``optimizer`` in this trace."""
        if self._h is None:
            raise WasmemError("Recorder.track: enter the recorder first (`with Recorder(...) as rec:`)")
        t = Tracker(self, model, optimizer)
        self._trackers.append(t)
        return t

    def save(self, path: str) -> None:
        """Writes the trace v1 recorded so far (``.gz``: compressed)."""
        if self._h is None:
            raise WasmemError("Recorder.save: nothing recorded (the recorder was never entered, or was closed)")
        self._lib.recorder_save(self._h, path)

    def plan_ahead(
        self,
        plan_cache: str | os.PathLike[str],
        policy: str = "planned",
        capacity: int | str | None = None,
        device: int | None = None,
    ) -> dict[str, Any]:
        """Plans the recorded training ahead of its first real step.

        Replays the trace recorded so far (three steps or more, tracked with
        :meth:`track`; seven or more when tensors outlive their next
        instance, e.g. ``out = model(x)`` kept, as steps are then planned
        two at a time) under ``policy`` (one with a planner) on a simulated
        device of ``capacity`` bytes (default: the memory of CUDA device
        ``device`` when CUDA is already initialised in this process, else
        80 GiB: this runs before :func:`wasmem.torch.enable`, which needs
        CUDA not initialised yet, so pass the GPU's size for a model that
        needs more), and writes its plans to
        the plan cache ``plan_cache`` (``{rank}`` and ``{device}`` replaced,
        as :func:`wasmem.torch.enable` does). A run started with
        ``enable(policy=..., plan_cache=...)`` on the same file is then
        served at planned offsets from its first request. A request the real
        run makes and the recording did not (a kernel's workspace) goes to
        the dynamic path; a run that differs more learns its plans and
        replaces the file. Returns the planning run's figures (``plans``,
        ``steady_plans`` — none: the steps after the first learn on the
        device —, ``period``, ``unsteady`` — true: steps that start alike
        differ later, the file holds no plan and the live run stays
        dynamic —, ``dynamic`` — true: no plan served the planning run, and
        the live run's dynamic path grows to its reserved bytes in a few
        device calls until a plan serves —, and the planning run's metrics: ``plan_refused``,
        ``plan_arena_bytes``, ``peak_live_bytes`` …, of a run that learns
        on the device as one without a cache does) and ``first_run``: the
        figures of the recording replayed again from the cache written, as
        the first live run starts (``plans_loaded``, ``plan_hits``,
        ``plan_misses``, ``plan_refused``, ``plan_arena_bytes``,
        ``peak_reserved_bytes``, ``overhead_ratio``, ``device_alloc_calls``).
        """
        if self._h is None:
            raise WasmemError("Recorder.plan_ahead: nothing recorded (the recorder was never entered, or was closed)")
        index = 0 if device is None else int(device)
        if capacity is None and torch.cuda.is_initialized():
            capacity = torch.cuda.get_device_properties(index).total_memory
        options = {"plan_cache": os.fspath(plan_cache), "policy": policy, "capacity": capacity, "device": index}
        return self._lib.recorder_plan(self._h, options)

    def stats(self) -> dict[str, Any]:
        """Counts: ``events``, ``allocs``, ``frees``, ``retags``, ``phases``,
        ``live_tensors``, ``live_bytes``, ``peak_live_bytes``."""
        if self._h is None:
            raise WasmemError("Recorder.stats: the recorder was never entered, or was closed")
        return self._lib.recorder_stats(self._h)

    def close(self) -> None:
        """Drops the trace (save it first)."""
        if self._h is not None:
            h, self._h = self._h, None
            self._lib.recorder_close(h)
        self._ids.clear()
        self._closed = True
