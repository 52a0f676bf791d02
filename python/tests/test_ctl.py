"""Live control from the library: each process of a job serves its own
socket (named by RANK), `wasmem ctl status` lists every rank of the node,
`wasmem ctl swap` swaps all of them or one (`--rank`). The processes run on
the simulated device; the CLI is this checkout's `wasmem`."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import env_for, wasmem_bin

RANK = """
import json, sys
from wasmem import capi
lib = capi.library()
lib.init({"device": "sim", "policy": "lifecycle", "shadow": "pytorch", "ctl": True})
p = lib.malloc(8 << 20, 0)
lib.phase("forward", 4)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "alloc":
        lib.free(lib.malloc(3 << 20, 0), 3 << 20, 0)
        print("done", flush=True)
    if line.strip() == "stats":
        print(json.dumps(lib.stats()), flush=True)
        break
"""


def start_rank(rank, runtime_dir):
    env = env_for({"RANK": str(rank), "LOCAL_RANK": str(rank), "XDG_RUNTIME_DIR": str(runtime_dir)})
    p = subprocess.Popen([sys.executable, "-c", RANK], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def ask(p, what):
    p.stdin.write(what + "\n")
    p.stdin.flush()
    return p.stdout.readline()


def ctl(runtime_dir, *args):
    env = env_for({"XDG_RUNTIME_DIR": str(runtime_dir)})
    return subprocess.run([str(wasmem_bin()), "ctl", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(wasmem_bin() is None, reason="the wasmem CLI is not built (cargo build --release -p wasmem)")
def test_ctl_status_and_swap_over_every_rank(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    ranks = [start_rank(r, runtime) for r in (0, 1)]
    try:
        st = ctl(runtime, "status", "--json")
        assert st.returncode == 0, st.stderr
        procs = json.loads(st.stdout)
        assert sorted(p["status"]["process_rank"] for p in procs) == [0, 1]
        for p in procs:
            s = p["status"]
            assert os.path.basename(p["socket"]).startswith(f"rank{s['process_rank']}-")
            assert s["step"] == 4 and s["ranks"][0]["device"] == 0
            assert s["ranks"][0]["policies"]["placement"] == "lifecycle"
            assert s["shadows"][0]["label"] == "pytorch" and s["shadows"][0]["events"] >= 1
        text = ctl(runtime, "status")
        assert text.returncode == 0 and "process rank 1" in text.stdout and "shadow of rank" in text.stdout
        # Every rank, then one rank.
        sw = ctl(runtime, "swap", "all", "pytorch")
        assert sw.returncode == 0, sw.stderr
        assert sw.stdout.count("→ pytorch") >= 2, sw.stdout
        one = ctl(runtime, "--rank", "1", "swap", "placement", "naive")
        assert one.returncode == 0, one.stderr
        bad = ctl(runtime, "swap", "all", "no-such-policy")
        assert bad.returncode != 0 and "no-such-policy" in bad.stderr
        none = ctl(runtime, "--rank", "7", "status")
        assert none.returncode != 0 and "rank 7" in none.stderr
        for r in ranks:
            assert ask(r, "alloc").strip() == "done"
        stats = [json.loads(ask(r, "stats")) for r in ranks]
    finally:
        for r in ranks:
            r.stdin.close()
            r.wait(timeout=30)
    p0, p1 = (s["devices"][0]["policies"] for s in stats)
    assert p0[:2] == ["pytorch", "pytorch"], p0
    assert p1 == ["naive", "pytorch", p0[2]], "--rank 1 swapped rank 1's placement only"
    assert stats[0]["ctl_socket"] and stats[0]["ctl_socket"] != stats[1]["ctl_socket"]
    # The sockets are removed at exit (the last one may take the directory with it).
    def sockets():
        d = runtime / "wasmem"
        return [p for p in d.iterdir() if p.suffix == ".sock"] if d.is_dir() else []

    deadline = time.time() + 10
    while time.time() < deadline and sockets():
        time.sleep(0.1)
    assert not sockets()
