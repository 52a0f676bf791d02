"""wasmem's statistics in PyTorch's shapes: the keys of
``torch.cuda.memory_stats()`` computed from one device of the library's
statistics JSON, with wasmem's own figures (and a shadow's) under
``wasmem.*`` keys. No torch needed.

Only keys wasmem measures are given (PyTorch's ``large_pool``/``small_pool``
split does not exist here; cumulative reserved bytes are not counted).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def device_entry(stats: dict[str, Any], device: int) -> dict[str, Any] | None:
    """The entry of ``device`` in the statistics JSON (``None``: not open)."""
    for d in stats.get("devices", []):
        if d.get("device_index") == device:
            return d
    return None


def torch_memory_stats(stats: dict[str, Any], device: int) -> "OrderedDict[str, Any]":
    """``torch.cuda.memory_stats(device)`` from the library's statistics:
    empty (as PyTorch answers for a device it has not used) when the device
    is not open."""
    d = device_entry(stats, device)
    out: dict[str, Any] = {}
    if d is None:
        return OrderedDict()
    g = lambda k: int(d.get(k) or 0)  # noqa: E731
    out["allocated_bytes.all.current"] = g("allocated_bytes")
    out["allocated_bytes.all.peak"] = g("peak_allocated_bytes")
    out["allocated_bytes.all.allocated"] = g("allocated_bytes_total")
    out["allocated_bytes.all.freed"] = g("freed_bytes_total")
    out["requested_bytes.all.current"] = g("requested_bytes")
    out["requested_bytes.all.peak"] = g("peak_requested_bytes")
    out["reserved_bytes.all.current"] = g("reserved_bytes")
    out["reserved_bytes.all.peak"] = g("peak_reserved_bytes")
    out["active_bytes.all.current"] = g("allocated_bytes") + g("pending_bytes")
    out["allocation.all.current"] = g("live_pointers")
    out["allocation.all.allocated"] = g("allocs")
    out["allocation.all.freed"] = g("frees")
    out["segment.all.current"] = g("segments")
    out["segment.all.allocated"] = g("device_alloc_calls")
    out["segment.all.freed"] = g("device_free_calls")
    out["num_alloc_retries"] = g("alloc_retries")
    out["num_ooms"] = g("ooms")
    out["num_device_alloc"] = g("device_alloc_calls")
    out["num_device_free"] = g("device_free_calls")
    out["num_sync_all_streams"] = g("device_syncs")
    out["wasmem.policy"] = stats.get("policy")
    for k in (
        "live_bytes",
        "peak_live_bytes",
        "cache_hits",
        "reclaimed_bytes",
        "policy_calls",
        "policy_fallbacks",
        "policy_traps",
        "deferred_frees",
        "gc_pauses",
        "stitched_bytes",
        "trimmed_bytes",
        "capacity_bytes",
    ):
        out[f"wasmem.{k}"] = g(k)
    sh = d.get("shadow")
    if sh:
        m = sh.get("metrics", {})
        out["wasmem.shadow.policy"] = sh.get("label")
        out["wasmem.shadow.reserved_bytes.all.peak"] = int(m.get("peak_reserved_bytes", 0))
        out["wasmem.shadow.allocated_bytes.all.peak"] = int(m.get("peak_allocated_bytes", 0))
        out["wasmem.shadow.num_ooms"] = int(m.get("ooms", 0))
        out["wasmem.shadow.num_device_alloc"] = int(m.get("device_alloc_calls", 0))
        out["wasmem.shadow.num_device_free"] = int(m.get("device_free_calls", 0))
        out["wasmem.shadow.events"] = int(m.get("events", 0))
        out["wasmem.shadow.errors"] = int(sh.get("errors", 0))
    return OrderedDict(sorted(out.items()))


def render(stats: dict[str, Any]) -> str:
    """A short text: one line per device, with its shadow."""
    lines = [f"wasmem policy {stats.get('policy')} on {stats.get('device')}"]
    for d in stats.get("devices", []):
        lines.append(
            f"device {d['device_index']}: reserved {d['reserved_bytes']} (peak {d['peak_reserved_bytes']}), "
            f"allocated {d['allocated_bytes']} (peak {d['peak_allocated_bytes']}), {d['ooms']} OOMs"
        )
        sh = d.get("shadow")
        if sh:
            m = sh.get("metrics", {})
            lines.append(
                f"  shadow {sh.get('label')}: peak reserved {m.get('peak_reserved_bytes')}, "
                f"peak allocated {m.get('peak_allocated_bytes')}, {m.get('ooms')} OOMs"
            )
    return "\n".join(lines)
