"""wasmem.torch without a GPU: enable()'s checks and errors, PyTorch's own
memory functions answering from wasmem (on the simulated device), the
pluggable-allocator hook-up (with PyTorch's CUDA entry points replaced by
fakes: the CUDA path itself needs a GPU, scripts/gpu-check.sh), and track()'s
refusals."""

import pytest

from conftest import last_json, run_py

torch = pytest.importorskip("torch")


def test_enable_without_a_gpu_says_what_to_do():
    p = run_py(
        """
import torch, wasmem.torch as wt
assert not torch.cuda.is_available()
try:
    wt.enable(policy="defrag")
except wt.WasmemError as e:
    print(e)
else:
    raise SystemExit("enabled without CUDA")
assert not wt.enabled()
"""
    )
    assert "no CUDA device" in p.stdout and "Recorder(device='meta')" in p.stdout


def test_enable_after_cuda_init_is_refused_with_the_fix():
    p = run_py(
        """
import torch, wasmem.torch as wt
torch.cuda.is_initialized = lambda: True
try:
    wt.enable()
except wt.WasmemError as e:
    print(e)
else:
    raise SystemExit("enabled after CUDA init")
"""
    )
    assert "before CUDA is initialised" in p.stdout and "right after `import torch`" in p.stdout


def test_enable_installs_the_pluggable_allocator_once():
    # PyTorch's CUDA entry points are replaced by fakes that record what they
    # get: the path of the library and the two symbols, which must exist.
    p = run_py(
        """
import ctypes, json, torch, wasmem.torch as wt
got = {}
class Fake:
    def __init__(self, path, alloc, free):
        lib = ctypes.CDLL(path)
        got.update(path=path, alloc=alloc, free=free, resolved=bool(getattr(lib, alloc)) and bool(getattr(lib, free)))
torch.cuda.is_available = lambda: True
torch.cuda.memory.CUDAPluggableAllocator = Fake
torch.cuda.memory.change_current_allocator = lambda a: got.update(installed=isinstance(a, Fake))
try:
    wt.enable(policy="no-such-policy")
except wt.WasmemError as e:
    got["unknown"] = str(e)
assert not wt.enabled() and "installed" not in got, "a bad policy installs nothing"
wt.enable(policy="defrag", shadow="pytorch")
try:
    wt.enable(policy="lifecycle")
except wt.WasmemError as e:
    got["twice"] = str(e)
got["stats"] = wt.stats()
print(json.dumps(got))
"""
    )
    o = last_json(p)
    assert o["path"].endswith("libwasmem_capi.so") and o["resolved"] and o["installed"]
    assert (o["alloc"], o["free"]) == ("wasmem_malloc", "wasmem_free")
    assert "unknown policy `no-such-policy`" in o["unknown"]
    assert "already called" in o["twice"] and "swap_policy" in o["twice"]
    assert (o["stats"]["policy"], o["stats"]["shadow_policy"], o["stats"]["device"]) == ("defrag", "pytorch", "cuda")


def test_torch_memory_functions_answer_from_wasmem(tmp_path):
    snap = tmp_path / "snap.pickle"
    p = run_py(
        f"""
import json, pickle, torch, wasmem.torch as wt
from wasmem import capi
wt.enable(policy="lifecycle", shadow="pytorch", device="sim", sim_capacity="2GiB", history=1000)
lib = capi.library()
assert torch.cuda.memory_stats(0) == {{}}
with wt.kind("activation"):
    a = lib.malloc(10 << 20, 0)
b = lib.malloc(1 << 20, 0)
lib.free(a, 10 << 20, 0)
out = {{
    "stats": torch.cuda.memory_stats(0),
    "allocated": torch.cuda.memory_allocated(0),
    "max_allocated": torch.cuda.max_memory_allocated(0),
    "reserved": torch.cuda.memory_reserved(0),
    "max_reserved": torch.cuda.max_memory_reserved(0),
}}
torch.cuda.reset_peak_memory_stats(0)
out["max_allocated_after_reset"] = torch.cuda.max_memory_allocated(0)
torch.cuda.empty_cache()
out["reserved_after_empty"] = torch.cuda.memory_reserved(0)
torch.cuda.memory._record_memory_history(max_entries=500)
torch.cuda.memory._dump_snapshot({str(snap)!r})
out["nested"] = torch.cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["current"]
print(json.dumps(out))
"""
    )
    o = last_json(p)
    s = o["stats"]
    assert o["allocated"] == s["allocated_bytes.all.current"] == 1 << 20
    assert o["max_allocated"] == s["allocated_bytes.all.peak"] == 11 << 20
    assert o["reserved"] == s["reserved_bytes.all.current"] >= o["allocated"]
    assert o["max_reserved"] == s["reserved_bytes.all.peak"] >= o["reserved"]
    assert s["wasmem.policy"] == "lifecycle" and s["wasmem.shadow.policy"] == "pytorch"
    assert s["wasmem.shadow.reserved_bytes.all.peak"] > 0
    assert o["max_allocated_after_reset"] == 1 << 20
    assert o["allocated"] <= o["reserved_after_empty"] < o["reserved"]
    assert o["nested"] == 1 << 20
    import pickle

    with open(snap, "rb") as f:
        d = pickle.load(f)
    assert set(d) >= {"segments", "device_traces"}
    assert sum(seg["total_size"] for seg in d["segments"]) == o["reserved_after_empty"]


def test_track_refuses_a_model_without_parameters():
    p = run_py(
        """
import torch, wasmem.torch as wt
wt.enable(device="sim")
try:
    wt.track(torch.nn.ReLU())
except ValueError as e:
    print(e)
else:
    raise SystemExit("tracked a model without parameters")
try:
    wt.track("not a model")
except TypeError as e:
    print(e)
"""
    )
    assert "has no parameters" in p.stdout and "expected a torch.nn.Module" in p.stdout


def test_track_needs_enable():
    p = run_py(
        """
import torch, wasmem.torch as wt
try:
    wt.track(torch.nn.Linear(2, 2))
except wt.WasmemError as e:
    print(e)
"""
    )
    assert "call wasmem.torch.enable() first" in p.stdout


def test_enable_takes_a_plan_cache(tmp_path):
    # enable(plan_cache=…) reaches the library: the second process is served
    # from the plans the first one kept (`{rank}` replaced by RANK).
    code = f"""
import json, wasmem.torch as wt
from wasmem import capi
wt.enable(policy="planned", device="sim", sim_capacity="1GiB", plan_cache={str(tmp_path / "p{rank}.json")!r})
lib = capi.library()
MIB = 1 << 20
with wt.kind("param"):
    params = [lib.malloc((2 + k) * MIB, 0) for k in range(3)]
for step in range(4):
    acts = [lib.malloc((3 + k) * MIB, 0) for k in range(5)]
    for k, a in reversed(list(enumerate(acts))):
        lib.free(a, (3 + k) * MIB, 0)
    lib.phase("step_end", step)
print(json.dumps(lib.stats()))
"""
    cold = last_json(run_py(code, {"RANK": "5"}))
    assert (tmp_path / "p5.json").is_file()
    warm = last_json(run_py(code, {"RANK": "5"}))
    assert (cold["policy"], cold["plans_loaded"]) == ("planned", 0)
    assert warm["plans_loaded"] >= 1 and warm["plan_misses"] == 0 and warm["device_alloc_calls"] <= 2, warm
