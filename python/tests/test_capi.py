"""The C ABI driven from Python on the simulated device (WASMEM_DEVICE=sim):
kinds, phases, re-tagging, statistics in PyTorch's keys, multi-device,
shadow, snapshots, configuration errors. No torch needed."""

import gzip
import json

from conftest import last_json, run_py

PRELUDE = """
import json, sys
from wasmem import capi, WasmemError
from wasmem.stats import torch_memory_stats
lib = capi.library()
MIB = 1 << 20
"""


def read_trace(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [json.loads(line) for line in f]
    assert lines[0]["format"] == "wasmem-trace" and lines[0]["version"] == 1
    return lines[1:]


def test_kinds_phases_retags_and_stats(tmp_path):
    trace = tmp_path / "t.jsonl"
    p = run_py(
        PRELUDE
        + f"""
lib.init({{"device": "sim", "policy": "lifecycle", "sim_capacity": "1GiB", "trace": True}})
assert lib.set_kind("param") is None
a = lib.malloc(1000)                  # param (current kind)
assert lib.set_kind(None) == "param"
b = lib.malloc(3 * MIB)               # other (the default kind)
assert lib.set_default_kind("temp") == "other"
c = lib.malloc(5 * MIB)               # temp
assert lib.retag(c, 0, "activation") is True
assert lib.retag(0x1234, 0, "grad") is False   # not ours: nothing to do
lib.phase("forward", 7)
lib.free(b, 3 * MIB)
lib.phase("backward", 7)
s = lib.stats()
lib.dump_trace({str(trace)!r})
print(json.dumps({{"s": s, "ms": torch_memory_stats(s, 0)}}))
"""
    )
    out = last_json(p)
    s, ms = out["s"], out["ms"]
    assert (s["phase"], s["step"], s["policy"]) == ("backward", 7, "lifecycle")
    rounded = 1024 + 5 * (1 << 20)
    assert ms["allocated_bytes.all.current"] == rounded
    assert ms["requested_bytes.all.current"] == 1000 + 5 * (1 << 20)
    assert ms["requested_bytes.all.peak"] == 1000 + 8 * (1 << 20)
    assert ms["allocation.all.current"] == 2 and ms["allocation.all.allocated"] == 3
    assert ms["allocated_bytes.all.allocated"] - ms["allocated_bytes.all.freed"] == rounded
    assert ms["reserved_bytes.all.current"] >= ms["allocated_bytes.all.current"]
    assert ms["reserved_bytes.all.current"] == s["devices"][0]["reserved_bytes"]
    assert ms["num_ooms"] == 0 and ms["num_alloc_retries"] == 0
    ev = read_trace(trace)
    allocs = [e for e in ev if e["op"] == "alloc"]
    assert [(e["bytes"], e["kind"]) for e in allocs] == [(1000, "param"), (3 << 20, "other"), (5 << 20, "activation")]
    assert [(e["name"], e["step"]) for e in ev if e["op"] == "phase"] == [("forward", 7), ("backward", 7)]
    assert [e["id"] for e in ev if e["op"] == "free"] == [allocs[1]["id"]]


def test_devices_shadow_empty_cache_peaks_and_snapshot(tmp_path):
    p = run_py(
        PRELUDE
        + """
lib.init({"device": "sim", "policy": "lifecycle", "shadow": "pytorch", "sim_capacity": "1GiB", "sim_devices": 2})
lib.record_history(10000)
ptrs = [(lib.malloc(n * MIB, d), n * MIB, d) for d in (0, 1) for n in (1, 3, 7, 20)]
try:
    lib.malloc(MIB, 2)
    raise SystemExit("device 2 was served")
except WasmemError as e:
    assert "no sim device 2" in str(e), e
for p, n, d in ptrs[:3] + ptrs[4:6]:
    lib.free(p, n, d)
before = lib.stats()
released = lib.empty_cache(0)
after = lib.stats()
lib.reset_peaks(-1)
reset = lib.stats()
snap = lib.snapshot(0)
empty = lib.snapshot(5)
print(json.dumps({"before": before, "after": after, "reset": reset, "released": released,
    "segments": snap["segments"], "traces": len(snap["device_traces"][0]), "empty": empty["segments"],
    "ms0": torch_memory_stats(after, 0), "ms1": torch_memory_stats(after, 1), "ms5": torch_memory_stats(after, 5)}))
"""
    )
    o = last_json(p)
    d0, d1 = o["before"]["devices"]
    assert (d0["device_index"], d1["device_index"]) == (0, 1), "one allocator per device"
    assert o["before"]["live_pointers"] == d0["live_pointers"] + d1["live_pointers"] == 3
    # empty_cache on device 0 only: its free cached segments go, device 1 keeps its own.
    a0, a1 = o["after"]["devices"]
    assert o["released"] == d0["reserved_bytes"] - a0["reserved_bytes"] > 0
    assert a1["reserved_bytes"] == d1["reserved_bytes"]
    assert a0["reserved_bytes"] >= a0["allocated_bytes"] == 20 << 20
    # Peaks reset to the current values.
    r0 = o["reset"]["devices"][0]
    assert r0["peak_reserved_bytes"] == r0["reserved_bytes"] < d0["peak_reserved_bytes"]
    assert r0["peak_allocated_bytes"] == r0["allocated_bytes"]
    # The shadow (pytorch) saw the same events on each device.
    for dev in o["after"]["devices"]:
        sh = dev["shadow"]
        assert sh["label"] == "pytorch" and sh["errors"] == 0
        assert sh["metrics"]["allocs"] == 4 and sh["metrics"]["peak_reserved_bytes"] > 0
    ms0 = o["ms0"]
    assert ms0["wasmem.shadow.policy"] == "pytorch"
    assert ms0["wasmem.shadow.reserved_bytes.all.peak"] == o["after"]["devices"][0]["shadow"]["metrics"]["peak_reserved_bytes"]
    assert o["ms5"] == {}, "a device never used has no statistics (as PyTorch answers)"
    # The snapshot: segments tile the reserved bytes; the history has the actions.
    assert sum(s["total_size"] for s in o["segments"]) == a0["reserved_bytes"]
    live_blocks = [b for s in o["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in live_blocks) == a0["allocated_bytes"]
    assert o["traces"] >= 8 and o["empty"] == []


def test_configuration_errors_are_clear_and_recoverable():
    p = run_py(
        PRELUDE
        + """
errors = {}
for bad in ({"policy": "no-such-policy"}, {"polcy": "x"}, {"device": "tpu"}, {"sim_devices": 0},
            {"shadow": "nope"}, {"sim_capacity": "lots"}):
    try:
        lib.init(dict(bad, device=bad.get("device", "sim")))
        raise SystemExit(f"accepted {bad}")
    except WasmemError as e:
        errors[json.dumps(bad)] = str(e)
lib.init({"device": "sim", "policy": "defrag"})     # a corrected call works
try:
    lib.init({"device": "sim"})
    raise SystemExit("configured twice")
except WasmemError as e:
    errors["twice"] = str(e)
for bad_kind in ("weights", 7):
    try:
        lib.set_kind(bad_kind)
        raise SystemExit("bad kind accepted")
    except (ValueError, TypeError) as e:
        errors[f"kind {bad_kind}"] = str(e)
try:
    lib.phase("warmup", 0)
    raise SystemExit("bad phase accepted")
except WasmemError as e:
    errors["phase"] = str(e)
lib.free(0xdead000, 64, 0)     # a foreign pointer: logged, no crash
print(json.dumps({"errors": errors, "stats": lib.stats()}))
"""
    )
    o = last_json(p)
    e = o["errors"]
    assert "unknown policy `no-such-policy`" in e['{"policy": "no-such-policy"}']
    assert "unknown setting `polcy`" in e['{"polcy": "x"}']
    assert "tpu" in e['{"device": "tpu"}']
    assert "sim_devices" in e['{"sim_devices": 0}']
    assert "nope" in e['{"shadow": "nope"}']
    assert "sim_capacity" in e['{"sim_capacity": "lots"}']
    assert "already configured" in e["twice"]
    assert "weights" in e["kind weights"]
    assert "phase" in e["phase"] and "warmup" in e["phase"]
    assert o["stats"]["policy"] == "defrag" and o["stats"]["errors"]["unknown_pointer"] == 1


def test_environment_configures_when_init_is_not_called():
    p = run_py(
        PRELUDE
        + """
a = lib.malloc(MIB, 1)
print(json.dumps(lib.stats()))
""",
        {"WASMEM_DEVICE": "sim", "WASMEM_POLICY": "pytorch", "WASMEM_SIM_CAPACITY": "512MiB", "RANK": "3"},
    )
    s = last_json(p)
    assert (s["policy"], s["rank"], s["device"]) == ("pytorch", 3, "sim")
    assert s["devices"][0]["device_index"] == 1 and s["devices"][0]["capacity_bytes"] == 512 << 20


def test_swap_applies_to_every_device_and_to_later_ones():
    p = run_py(
        PRELUDE
        + """
lib.init({"device": "sim", "policy": "lifecycle", "sim_devices": 3})
lib.malloc(MIB, 0)
lib.swap_policy("pytorch")
lib.malloc(MIB, 2)                          # opens after the swap: opens with it
try:
    lib.swap_policy("no-such-policy")
    raise SystemExit("swapped to nothing")
except WasmemError as e:
    assert "no-such-policy" in str(e)
print(json.dumps(lib.stats()))
"""
    )
    s = last_json(p)
    assert s["policy"] == "pytorch"
    assert [d["device_index"] for d in s["devices"]] == [0, 2]
    # `pytorch` provides placement and reclamation; eviction keeps its policy.
    names = [d["policies"] for d in s["devices"]]
    assert names[0][:2] == ["pytorch", "pytorch"] and names[0] == names[1], names


def hostile_policy():
    """The hostile test policy of tests/hostile (built on first use, as the
    engine's own tests build it); None without the wasm32-wasip2 target."""
    import os
    import shutil
    import subprocess

    from conftest import REPO

    out = REPO / "tests/hostile/out/hostile.wasm"
    if out.is_file():
        return out
    if shutil.which("cargo") is None:
        return None
    targets = subprocess.run(["rustup", "target", "list", "--installed"], capture_output=True, text=True)
    if "wasm32-wasip2" not in targets.stdout:
        return None
    env = dict(os.environ, HOSTILE_TARGET_DIR=str(REPO / "target/hostile"))
    subprocess.run(["bash", str(REPO / "tests/hostile/build.sh")], check=True, env=env, timeout=900)
    return out


def test_a_policy_that_traps_falls_back_and_loses_nothing():
    import pytest

    wasm = hostile_policy()
    if wasm is None:
        pytest.skip("the hostile test policy cannot be built here (rustup target add wasm32-wasip2)")
    p = run_py(
        PRELUDE
        + f"""
lib.init({{"device": "sim", "policy": "{wasm}?mode=trap-nth n=2"}})
ptrs = [lib.malloc((i % 5 + 1) * MIB) for i in range(12)]
assert len(set(ptrs)) == 12 and all(ptrs)
for q in ptrs:
    lib.free(q, 0)
try:
    lib.swap_policy("{wasm}?mode=trap-init")
    raise SystemExit("a policy that traps in init was swapped in")
except WasmemError as e:
    print("refused:", e)
print(json.dumps(lib.stats()))
"""
    )
    s = last_json(p)
    assert s["policy_traps"] >= 1 and s["policy_fallbacks"] >= 1, s
    assert s["allocs"] == s["frees"] == 12 and s["live_pointers"] == 0
    assert "refused:" in p.stdout and "hostile" in p.stdout


def test_a_plan_cache_plans_the_next_process_from_its_first_request(tmp_path):
    # Two processes of the same training: the first learns its plans and
    # keeps them in the cache; the second is served from its first request.
    cache = tmp_path / "plans.rank{rank}.json"
    code = (
        PRELUDE
        + f"""
lib.init({{"device": "sim", "policy": "planned", "sim_capacity": "1GiB", "plan_cache": {str(cache)!r}}})
lib.set_kind("param")
params = [lib.malloc((3 + k) * MIB) for k in range(4)]
lib.set_kind(None)
grads = []
for step in range(5):
    for g in grads:
        lib.free(g, 2 * MIB)
    acts = [lib.malloc((4 + k) * MIB) for k in range(6)]
    for k, a in reversed(list(enumerate(acts))):
        lib.free(a, (4 + k) * MIB)
    grads = [lib.malloc(2 * MIB) for _ in range(3)]
    lib.phase("step_end", step)
print(json.dumps(lib.stats()))
"""
    )
    cold = last_json(run_py(code, {"RANK": "1"}))
    assert (tmp_path / "plans.rank1.json").is_file()
    warm = last_json(run_py(code, {"RANK": "1"}))
    assert cold["plans_loaded"] == 0 and warm["plans_loaded"] >= 2, warm
    assert warm["plan_misses"] == 0 and warm["device_alloc_calls"] <= 2, warm
    assert warm["peak_reserved_bytes"] <= cold["peak_reserved_bytes"]
