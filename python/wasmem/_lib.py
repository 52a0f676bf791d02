"""The C ABI of ``libwasmem_capi.so`` through ctypes: finding the library,
its function signatures, and errors turned into Python exceptions.

Every function of the library returns -1 (or null) on failure and keeps the
message for the calling thread (``wasmem_last_error``); :class:`Library`
raises :class:`WasmemError` with that message.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import threading
from pathlib import Path
from typing import Any

#: Tensor kinds, in the order of their C codes (0 ``param`` … 5 ``other``).
KINDS = ("param", "grad", "optim", "activation", "temp", "other")
#: Training phases a phase mark may name.
PHASES = ("forward", "backward", "optimizer", "step_end")

_LIB_NAME = "libwasmem_capi.so"


class WasmemError(RuntimeError):
    """A call into wasmem failed; the message says why (and how to fix it)."""


def kind_code(kind: str | None) -> int:
    """The C code of a kind name (``None``: -1, no kind)."""
    if kind is None:
        return -1
    try:
        return KINDS.index(kind)
    except ValueError:
        raise ValueError(f"unknown tensor kind {kind!r}; kinds: {', '.join(KINDS)}") from None


def kind_name(code: int) -> str | None:
    """The kind name of a C code (-1: ``None``)."""
    return None if code == -1 else KINDS[code]


def library_path() -> Path:
    """Where ``libwasmem_capi.so`` is: ``$WASMEM_CAPI_LIB``, else the copy
    installed inside this package (``pip install ./python`` puts it there),
    else the build tree's ``target/release`` when the package runs from a
    checkout."""
    env = os.environ.get("WASMEM_CAPI_LIB")
    if env:
        p = Path(env)
        if not p.is_file():
            raise WasmemError(f"WASMEM_CAPI_LIB={env}: no such file")
        return p
    here = Path(__file__).resolve().parent
    candidates = [here / _LIB_NAME]
    target = os.environ.get("CARGO_TARGET_DIR")
    repo = here.parent.parent
    if target:
        candidates.append(Path(target) / "release" / _LIB_NAME)
    candidates.append(repo / "target" / "release" / _LIB_NAME)
    for c in candidates:
        if c.is_file():
            return c
    raise WasmemError(
        f"{_LIB_NAME} not found (looked at {', '.join(str(c) for c in candidates)}): "
        "install the package with `pip install ./python` from a wasmem checkout (it builds the library with cargo), "
        "or build it with `cargo build --release -p wasmem-capi` and set WASMEM_CAPI_LIB to its path"
    )


_c = ctypes
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "wasmem_malloc": (_c.c_void_p, [_c.c_ssize_t, _c.c_int, _c.c_void_p]),
    "wasmem_free": (None, [_c.c_void_p, _c.c_ssize_t, _c.c_int, _c.c_void_p]),
    "wasmem_init": (_c.c_int, [_c.c_char_p]),
    "wasmem_last_error": (_c.c_int, [_c.c_char_p, _c.c_size_t]),
    "wasmem_stats_json": (_c.c_int, [_c.c_char_p, _c.c_size_t]),
    "wasmem_set_kind": (_c.c_int, [_c.c_int]),
    "wasmem_set_default_kind": (_c.c_int, [_c.c_int]),
    "wasmem_retag": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_int]),
    "wasmem_phase": (_c.c_int, [_c.c_char_p, _c.c_uint64]),
    "wasmem_empty_cache": (_c.c_int64, [_c.c_int]),
    "wasmem_reset_peaks": (_c.c_int, [_c.c_int]),
    "wasmem_record_history": (_c.c_int, [_c.c_size_t]),
    "wasmem_snapshot": (_c.c_int64, [_c.c_int, _c.c_char_p, _c.c_size_t]),
    "wasmem_dump_trace": (_c.c_int, [_c.c_char_p]),
    "wasmem_swap_policy": (_c.c_int, [_c.c_char_p]),
    "wasmem_recorder_open": (_c.c_int64, [_c.c_char_p]),
    "wasmem_recorder_alloc": (_c.c_int64, [_c.c_int64, _c.c_uint64, _c.c_int, _c.c_uint32]),
    "wasmem_recorder_free": (_c.c_int, [_c.c_int64, _c.c_uint64]),
    "wasmem_recorder_retag": (_c.c_int, [_c.c_int64, _c.c_uint64, _c.c_int]),
    "wasmem_recorder_phase": (_c.c_int, [_c.c_int64, _c.c_char_p, _c.c_uint64]),
    "wasmem_recorder_save": (_c.c_int, [_c.c_int64, _c.c_char_p]),
    "wasmem_recorder_stats": (_c.c_int, [_c.c_int64, _c.c_char_p, _c.c_size_t]),
    "wasmem_recorder_plan": (_c.c_int, [_c.c_int64, _c.c_char_p]),
    "wasmem_recorder_close": (_c.c_int, [_c.c_int64]),
}


def _b(s: str | os.PathLike[str]) -> bytes:
    return os.fsencode(s)


class Library:
    """``libwasmem_capi.so``, loaded once per process (see :func:`library`)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        self._dll = ctypes.CDLL(self.path)
        for name, (res, args) in _SIGNATURES.items():
            try:
                f = getattr(self._dll, name)
            except AttributeError:
                raise WasmemError(
                    f"{self.path} has no `{name}`: it is an older build of the library; rebuild it "
                    "(`cargo build --release -p wasmem-capi`, or `pip install ./python` again)"
                ) from None
            f.restype = res
            f.argtypes = args

    def _f(self, name: str):
        return getattr(self._dll, name)

    # -- errors and text ---------------------------------------------------
    def last_error(self) -> str:
        """The message of this thread's last failure."""
        return self._text(lambda buf, n: self._f("wasmem_last_error")(buf, n)) or "(no message)"

    def _fail(self, what: str) -> WasmemError:
        msg = self.last_error()
        # The library's message names its function; say what was asked when
        # that is not the same words.
        return WasmemError(msg if msg.startswith(what) else f"{what}: {msg}")

    def _check(self, rc: int, what: str) -> int:
        if rc == -1:
            raise self._fail(what)
        return rc

    def _text(self, call) -> str:
        """Reads a text the library writes as ``wasmem_stats_json`` does."""
        size = 4096
        for _ in range(8):
            buf = ctypes.create_string_buffer(size)
            n = call(buf, size)
            if n < 0:
                return ""
            if n < size:
                return buf.value.decode("utf-8", "replace")
            size = n + 4096
        raise WasmemError("a text from the library kept growing while it was read")

    # -- the process-wide allocator ---------------------------------------
    def init(self, settings: dict[str, Any]) -> None:
        """Configures the library before its first use (``wasmem_init``)."""
        self._check(self._f("wasmem_init")(json.dumps(settings).encode()), "wasmem_init")

    def stats(self) -> dict[str, Any]:
        """The statistics JSON (``wasmem_stats_json``) as a dict."""
        f = self._f("wasmem_stats_json")
        n = f(None, 0)
        if n < 0:
            raise self._fail("wasmem_stats_json")
        text = self._text(lambda buf, size: f(buf, size))
        if not text:
            raise self._fail("wasmem_stats_json")
        return json.loads(text)

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        """Allocates (as PyTorch would through the pluggable allocator);
        raises on failure."""
        p = self._f("wasmem_malloc")(size, device, stream or None)
        if not p:
            if size == 0:
                return 0
            raise self._fail(f"allocation of {size} bytes on device {device}")
        return int(p)

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> None:
        """Frees (as PyTorch would); a bad pointer is logged by the library."""
        self._f("wasmem_free")(ptr or None, size, device, stream or None)

    def set_kind(self, kind: str | None) -> str | None:
        """Sets this thread's current kind; returns the previous one."""
        prev = self._f("wasmem_set_kind")(kind_code(kind))
        if prev == -2:
            raise self._fail("wasmem_set_kind")
        return kind_name(prev)

    def set_default_kind(self, kind: str) -> str:
        """Sets the kind of allocations made without a current kind."""
        prev = self._f("wasmem_set_default_kind")(kind_code(kind))
        if prev < 0:
            raise self._fail("wasmem_set_default_kind")
        return KINDS[prev]

    def retag(self, ptr: int, device: int, kind: str) -> bool:
        """Gives the storage at ``ptr`` the kind; ``False`` when it is not
        memory of this library."""
        return bool(self._check(self._f("wasmem_retag")(ptr or None, device, kind_code(kind)), "wasmem_retag"))

    def phase(self, name: str, step: int) -> None:
        """Marks a phase on every device."""
        self._check(self._f("wasmem_phase")(name.encode(), step), f"phase {name}")

    def empty_cache(self, device: int = -1) -> int:
        """Releases cached memory; returns the bytes released."""
        return self._check(self._f("wasmem_empty_cache")(device), "empty_cache")

    def reset_peaks(self, device: int = -1) -> None:
        """Peaks back to the current values."""
        self._check(self._f("wasmem_reset_peaks")(device), "reset_peak_memory_stats")

    def record_history(self, max_entries: int) -> None:
        """Keeps the last ``max_entries`` allocator actions per device (0: off)."""
        self._check(self._f("wasmem_record_history")(max_entries), "record_memory_history")

    def snapshot(self, device: int) -> dict[str, Any]:
        """The memory snapshot of ``device`` in the shape of
        ``torch.cuda.memory._snapshot()``."""
        f = self._f("wasmem_snapshot")
        for _ in range(8):
            n = self._check(f(device, None, 0), "snapshot")
            buf = ctypes.create_string_buffer(n + 65536)
            m = self._check(f(device, buf, len(buf)), "snapshot")
            if m <= len(buf):
                # Our own library's pickle (segments and trace entries only).
                return pickle.loads(buf.raw[:m])
        raise WasmemError("the snapshot kept growing while it was read")

    def dump_trace(self, path: str | os.PathLike[str] | None = None) -> None:
        """Writes the trace v1 recorded so far (tracing on at start-up)."""
        self._check(self._f("wasmem_dump_trace")(None if path is None else _b(path)), "dump_trace")

    def swap_policy(self, spec: str) -> None:
        """Swaps every device to the roles ``spec`` provides."""
        self._check(self._f("wasmem_swap_policy")(spec.encode()), f"swap to {spec!r}")

    # -- recorders ---------------------------------------------------------
    def recorder_open(self, source: str) -> int:
        """Opens a recorder; returns its handle."""
        return self._check(self._f("wasmem_recorder_open")(source.encode()), "recorder")

    def recorder_alloc(self, h: int, nbytes: int, kind: str | None, stream: int = 0) -> int:
        """Records an allocation; returns its id."""
        return self._check(self._f("wasmem_recorder_alloc")(h, nbytes, kind_code(kind), stream), "recorder alloc")

    def recorder_free(self, h: int, ident: int) -> None:
        """Records a free."""
        self._check(self._f("wasmem_recorder_free")(h, ident), "recorder free")

    def recorder_retag(self, h: int, ident: int, kind: str) -> None:
        """Gives a live id its kind from its allocation on."""
        self._check(self._f("wasmem_recorder_retag")(h, ident, kind_code(kind)), "recorder retag")

    def recorder_phase(self, h: int, name: str, step: int) -> None:
        """Records a phase mark."""
        self._check(self._f("wasmem_recorder_phase")(h, name.encode(), step), f"recorder phase {name}")

    def recorder_save(self, h: int, path: str | os.PathLike[str]) -> None:
        """Writes the recorder's trace v1."""
        self._check(self._f("wasmem_recorder_save")(h, _b(path)), f"saving the trace to {path}")

    def recorder_stats(self, h: int) -> dict[str, Any]:
        """The recorder's counts."""
        f = self._f("wasmem_recorder_stats")
        if f(h, None, 0) < 0:
            raise self._fail("recorder stats")
        return json.loads(self._text(lambda buf, n: f(h, buf, n)))

    def recorder_plan(self, h: int, options: dict[str, Any]) -> dict[str, Any]:
        """Plans ahead from the recorder's trace into a plan cache; returns the figures."""
        self._check(self._f("wasmem_recorder_plan")(h, json.dumps(options).encode()), "planning ahead")
        return self.recorder_stats(h)["plan"]

    def recorder_close(self, h: int) -> None:
        """Closes a recorder."""
        self._check(self._f("wasmem_recorder_close")(h), "recorder close")


_LOCK = threading.Lock()
_LIBRARY: Library | None = None


def library() -> Library:
    """The library of this process, loaded on first use."""
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is None:
            _LIBRARY = Library(library_path())
        return _LIBRARY
