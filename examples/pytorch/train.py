#!/usr/bin/env python3
"""Train a small GPT with PyTorch's own CUDA allocator, or with wasmem's.

    python3 train.py --allocator pytorch          # reference run
    python3 train.py --allocator wasmem           # through the wasmem package
                                                  # (wasmem.torch.enable + track)
    python3 train.py --compare --out DIR          # both, in separate processes,
                                                  # losses compared step for step
    python3 train.py --compare-files A.json B.json  # compare two saved runs

The model (token + position embeddings, pre-norm transformer blocks with
hand-written causal attention, LM head, cross-entropy by hand) trains for --steps steps on
a synthetic, learnable sequence task generated from --seed. Everything is
deterministic (torch.manual_seed, torch.use_deterministic_algorithms(True, warn_only=True),
CUBLAS_WORKSPACE_CONFIG=:4096:8, no TF32, no dropout), so the allocator must
not change a single bit of the losses: --compare checks exact equality by
default (--rtol relaxes it).

Exit status: 0 ok (and, with --compare, the losses match); 1 the losses
differ; 2 a run failed; 3 no PyTorch, no CUDA, or no libwasmem_capi.so.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

# Must be in the environment before CUDA (cuBLAS) initializes.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MIB = 1 << 20
EXIT_OK, EXIT_MISMATCH, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 2, 3


def find_library(explicit=None):
    """The path of libwasmem_capi.so, or None."""
    candidates = [explicit, os.environ.get("WASMEM_CAPI_LIB")]
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        candidates.append(os.path.join(target, "release", "libwasmem_capi.so"))
    candidates += [
        os.path.join(REPO, "target", "gpu-check", "libwasmem_capi.so"),
        os.path.join(REPO, "target", "release", "libwasmem_capi.so"),
    ]
    for c in candidates:
        if c and os.path.isfile(c):
            return os.path.abspath(c)
    return None


def import_wasmem_torch():
    """`wasmem.torch`: the installed package (`pip install ./python`), else
    the checkout's `python/` (a GPU machine without a registry)."""
    try:
        import wasmem.torch as wt
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "python"))
        import wasmem.torch as wt
    return wt


# ---------------------------------------------------------------- training


def build(torch, args):
    """Model, optimizer and batch generator (all deterministic)."""
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x, mask):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
            att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            # Embeddings as plain matrices (one-hot @ matrix, a slice): their
            # backward is a matmul and a copy, deterministic on every GPU.
            self.tok = nn.Parameter(torch.randn(args.vocab, args.d_model) * 0.02)
            self.pos = nn.Parameter(torch.randn(args.seq, args.d_model) * 0.02)
            self.blocks = nn.ModuleList(Block(args.d_model, args.heads) for _ in range(args.layers))
            self.ln = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab, bias=False)
            self.register_buffer("mask", torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), 1))

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = F.one_hot(idx, args.vocab).to(self.tok.dtype) @ self.tok + self.pos[:t]
            for blk in self.blocks:
                x = blk(x, self.mask)
            logp = self.head(self.ln(x)).log_softmax(dim=-1)
            # Cross-entropy without nll_loss (whose CUDA kernels may use atomics).
            return -(logp * F.one_hot(targets, args.vocab).to(logp.dtype)).sum(dim=-1).mean()

    torch.manual_seed(args.seed)
    model = GPT()  # initialized on the CPU: the CPU generator decides every weight
    gen = torch.Generator().manual_seed(args.seed + 1)

    def batch():
        # A learnable rule: x[t] = (5·x[t-1] + 3·x[t-2] + 7) mod vocab, random first two tokens.
        x = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        x[:, :2] = torch.randint(0, args.vocab, (args.batch, 2), generator=gen)
        for t in range(2, args.seq + 1):
            x[:, t] = (5 * x[:, t - 1] + 3 * x[:, t - 2] + 7) % args.vocab
        return x[:, :-1], x[:, 1:]

    return model, batch


def plan_ahead(torch, wt, args):
    """Records the training on the meta device (8 steps, nothing computed,
    no GPU memory) the way the live run allocates — the model built on the
    CPU and moved, batches made on the CPU and moved — and plans it ahead
    into the plan cache args.plan_ahead; returns the planning run's figures."""
    with wt.Recorder(device="meta") as rec:
        with torch.device("cpu"):
            model, batch = build(torch, args)
        model = model.to("meta")
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if not args.no_track:
            rec.track(model, opt)
        for _ in range(8):
            with torch.device("cpu"):
                x, y = batch()
            x, y = x.to("meta"), y.to("meta")
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        del loss
        return rec.plan_ahead(args.plan_ahead, policy=args.policy)


def mem_line(rec):
    m = rec["mem"]
    if "reserved_bytes" in m:  # wasmem
        return "wasmem live {:8.1f} MiB  reserved {:8.1f} MiB  peak {:8.1f} MiB  [{}]".format(
            m["live_bytes"] / MIB, m["reserved_bytes"] / MIB, m["peak_reserved_bytes"] / MIB, m["policy"]
        )
    return "torch allocated {:8.1f} MiB  reserved {:8.1f} MiB  peak {:8.1f} MiB".format(
        m["allocated"] / MIB, m["reserved"] / MIB, m["max_reserved"] / MIB
    )


def train(args):
    """One training run; returns an exit status and writes --json."""
    try:
        import torch
    except ImportError as e:
        print(f"train.py: PyTorch is not installed ({e})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if not torch.cuda.is_available():
        print("train.py: CUDA is not available (no GPU or no driver): nothing to run", file=sys.stderr)
        return EXIT_UNAVAILABLE

    wt = None
    if args.allocator == "wasmem":
        lib = find_library(args.lib)
        if lib is None:
            print(
                "train.py: libwasmem_capi.so not found: build it with "
                "`cargo build --release -p wasmem-capi` or pass --lib",
                file=sys.stderr,
            )
            return EXIT_UNAVAILABLE
        os.environ["WASMEM_CAPI_LIB"] = lib
        wt = import_wasmem_torch()
        if args.plan_ahead:
            t = time.perf_counter()
            planned = plan_ahead(torch, wt, args)
            print(f"train.py: planned ahead on the meta device in {time.perf_counter() - t:.2f} s: {planned}")
        # Before anything allocates on the GPU.
        wt.enable(
            policy=args.policy,
            shadow=args.shadow,
            ctl=args.ctl,
            trace_out=args.trace_out,
            history=args.history,
            plan_cache=args.plan_ahead,
        )
        print(f"train.py: allocator wasmem ({lib}), policy {args.policy}, shadow {args.shadow}")
        if args.ctl:
            print(f"train.py: control socket {wt.stats()['ctl_socket']}", flush=True)
    else:
        print("train.py: allocator pytorch (CUDACachingAllocator)")

    # warn_only: an op without a deterministic kernel warns (in the log)
    # instead of stopping the run; the loss comparison then tells.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda", 0)
    model, batch = build(torch, args)
    if wt is not None:
        # Parameters are `param` from their first byte: their small growths
        # share device allocations, as PyTorch's 20 MiB segments do.
        with wt.kind("param"):
            model = model.to(dev)
    else:
        model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    params = sum(p.numel() for p in model.parameters())
    if wt is not None and not args.no_track:
        wt.track(model, opt)
    print(f"train.py: {params / 1e6:.2f} M parameters on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")

    records, swaps = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if wt is not None and args.swap_at is not None and step == args.swap_at:
            try:
                wt.swap_policy(args.swap_policy)
                ok = True
            except wt.WasmemError as e:
                print(f"train.py: {e}", file=sys.stderr)
                ok = False
            swaps.append({"step": step, "policy": args.swap_policy, "ok": ok})
            print(f"train.py: swap to policy {args.swap_policy} before step {step}: {'ok' if ok else 'FAILED'}")
        x, y = batch()
        x, y = x.to(dev), y.to(dev)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()  # synchronizes
        if wt is not None:
            s = wt.stats()
            keys = ("live_bytes", "allocated_bytes", "reserved_bytes", "peak_reserved_bytes", "policy")
            mem = {k: s[k] for k in keys}
        else:
            mem = {
                "allocated": torch.cuda.memory_allocated(dev),
                "reserved": torch.cuda.memory_reserved(dev),
                "max_reserved": torch.cuda.max_memory_reserved(dev),
            }
        rec = {"step": step, "loss": value, "loss_hex": float.hex(value), "mem": mem}
        records.append(rec)
        print(f"step {step:3d}  loss {value:.10f}  | {mem_line(rec)}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)  # room for a `wasmem ctl swap` from another process
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0

    result = {
        "allocator": args.allocator,
        "steps": records,
        "wall_s": wall,
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "parameters": params,
        "swaps": swaps,
    }
    # With wasmem these are wasmem's figures (enable() makes torch.cuda's
    # memory functions answer from it), in PyTorch's keys.
    st = torch.cuda.memory_stats(dev)
    result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    result["torch_stats"] = {
        k: st.get(k)
        for k in (
            "allocated_bytes.all.peak",
            "reserved_bytes.all.peak",
            "num_alloc_retries",
            "num_ooms",
            "num_device_alloc",
            "num_device_free",
        )
    }
    if wt is not None:
        result["policy"] = args.policy
        result["wasmem_stats"] = wt.stats()
        result["wasmem_memory_stats"] = dict(st)
        if args.trace_out:
            wt.dump_trace(args.trace_out)
            result["trace"] = args.trace_out
    if args.snapshot:
        torch.cuda.memory._dump_snapshot(args.snapshot)
        result["snapshot"] = args.snapshot
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"train.py: {args.steps} steps in {wall:.2f} s; peak reserved {result['peak_reserved_bytes'] / MIB:.1f} MiB")
    return EXIT_OK


# ---------------------------------------------------------------- comparison


def compare_results(ref, was, rtol):
    """(summary dict, table lines) for two run results."""
    lines = []
    hdr = f"{'step':>4}  {'loss (pytorch)':>16}  {'loss (wasmem)':>16}  {'same':>5}  {'torch reserved':>14}  {'wasmem reserved':>15}  {'wasmem live':>11}  policy"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    max_rel, exact, ok = 0.0, True, True
    n = min(len(ref["steps"]), len(was["steps"]))
    for a, b in zip(ref["steps"], was["steps"]):
        la, lb = a["loss"], b["loss"]
        same = a["loss_hex"] == b["loss_hex"]
        rel = abs(la - lb) / max(abs(la), 1e-30) if not same else 0.0
        if not (math.isfinite(rel)):
            rel = math.inf
        max_rel = max(max_rel, rel)
        exact &= same
        ok &= same if rtol == 0 else rel <= rtol
        lines.append(
            f"{a['step']:4d}  {la:16.10f}  {lb:16.10f}  {'yes' if same else 'NO':>5}  "
            f"{a['mem']['reserved'] / MIB:10.1f} MiB  {b['mem']['reserved_bytes'] / MIB:11.1f} MiB  "
            f"{b['mem']['live_bytes'] / MIB:7.1f} MiB  {b['mem']['policy']}"
        )
    if len(ref["steps"]) != len(was["steps"]) or n == 0:
        ok = False
    tp, wp = ref["peak_reserved_bytes"], was["peak_reserved_bytes"]
    summary = {
        "match": ok,
        "criterion": "exact (bitwise) equality" if rtol == 0 else f"relative difference <= {rtol:g}",
        "exact": exact and len(ref["steps"]) == len(was["steps"]),
        "max_rel_diff": max_rel,
        "steps": n,
        "loss_first": ref["steps"][0]["loss"] if n else None,
        "loss_last": ref["steps"][n - 1]["loss"] if n else None,
        "torch_peak_reserved_bytes": tp,
        "wasmem_peak_reserved_bytes": wp,
        "wasmem_over_torch_peak_reserved": (wp / tp) if tp else None,
        "torch_wall_s": ref.get("wall_s"),
        "wasmem_wall_s": was.get("wall_s"),
        "wasmem_policy": was.get("policy"),
        "wasmem_swaps": was.get("swaps", []),
        "wasmem_errors": was.get("wasmem_stats", {}).get("errors", {}),
        "wasmem_device_alloc_calls": was.get("wasmem_stats", {}).get("device_alloc_calls"),
        "wasmem_device_free_calls": was.get("wasmem_stats", {}).get("device_free_calls"),
        "torch_stats": ref.get("torch_stats"),
        "device": ref.get("device"),
        "torch": ref.get("torch"),
        "trace": was.get("trace"),
    }
    lines.append("")
    lines.append(
        f"losses: {'MATCH' if ok else 'MISMATCH'} over {n} steps ({summary['criterion']}; max relative difference {max_rel:.3g})"
    )
    lines.append(
        f"peak reserved: pytorch {tp / MIB:.1f} MiB, wasmem {wp / MIB:.1f} MiB"
        + (f" ({wp / tp:.3f}x)" if tp else "")
        + f"; wall: pytorch {ref.get('wall_s', 0):.2f} s, wasmem {was.get('wall_s', 0):.2f} s"
    )
    return summary, lines


def finish_compare(ref, was, args):
    summary, lines = compare_results(ref, was, args.rtol)
    print("\n".join(lines))
    if args.out:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return EXIT_OK if summary["match"] else EXIT_MISMATCH


def compare(args):
    """Runs both allocators in separate processes and compares them."""
    out = args.out or tempfile.mkdtemp(prefix="wasmem-pytorch-")
    os.makedirs(out, exist_ok=True)
    args.out = out
    lib = find_library(args.lib)
    if lib is None:
        print("train.py: libwasmem_capi.so not found (cargo build --release -p wasmem-capi, or --lib)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    common = [
        sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--seed", str(args.seed),
        "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
        "--d-model", str(args.d_model), "--heads", str(args.heads), "--layers", str(args.layers),
        "--lr", repr(args.lr),
    ]  # fmt: skip
    runs = {
        "pytorch": common + ["--allocator", "pytorch"],
        "wasmem": common
        + ["--allocator", "wasmem", "--lib", lib, "--policy", args.policy]
        + ["--trace-out", os.path.join(out, "wasmem-trace.jsonl.gz")]
        + (["--shadow", args.shadow] if args.shadow else [])
        + (["--plan-ahead", args.plan_ahead] if args.plan_ahead else [])
        + ([] if args.swap_at is None else ["--swap-at", str(args.swap_at), "--swap-policy", args.swap_policy]),
    }
    results = {}
    for name, cmd in runs.items():
        path = os.path.join(out, f"{name}.json")
        print(f"== {name} run ==", flush=True)
        with open(os.path.join(out, f"{name}.log"), "w") as log:
            p = subprocess.Popen(cmd + ["--json", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in p.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = p.wait()
        if rc != 0:
            print(f"train.py: the {name} run failed (exit {rc}); log in {out}/{name}.log", file=sys.stderr)
            return EXIT_UNAVAILABLE if rc == EXIT_UNAVAILABLE else EXIT_FAILED
        with open(path) as f:
            results[name] = json.load(f)
    print(f"== comparison (results in {out}) ==")
    return finish_compare(results["pytorch"], results["wasmem"], args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allocator", choices=["pytorch", "wasmem"], default="pytorch")
    p.add_argument("--compare", action="store_true", help="run both allocators and compare the losses")
    p.add_argument("--compare-files", nargs=2, metavar=("PYTORCH_JSON", "WASMEM_JSON"))
    p.add_argument("--out", help="--compare: directory for the results, logs, trace and summary.json")
    p.add_argument("--rtol", type=float, default=0.0, help="allowed relative loss difference (default 0: bitwise)")
    p.add_argument("--lib", help="path of libwasmem_capi.so (default: $WASMEM_CAPI_LIB, target/…)")
    p.add_argument("--policy", default="lifecycle", help="wasmem policy spec (WASMEM_POLICY)")
    p.add_argument("--swap-at", type=int, help="hot-swap the wasmem policy before this step")
    p.add_argument("--swap-policy", default="pytorch", help="policy spec to swap to")
    p.add_argument("--no-swap", action="store_true", help="--compare: do not hot-swap (default: at steps/2)")
    p.add_argument("--trace-out", help="wasmem: record the allocations and write a trace v1 here")
    p.add_argument("--json", help="write this run's results here")
    p.add_argument("--shadow", help="wasmem: a shadow policy run on the same events (bookkeeping only)")
    p.add_argument(
        "--plan-ahead",
        help="wasmem, a policy with a planner: record the training on the meta device first and plan it into "
        "this plan cache, so that the run is served at planned offsets from its first step",
    )
    p.add_argument("--ctl", action="store_true", help="wasmem: serve the control socket (wasmem ctl)")
    p.add_argument("--history", type=int, default=0, help="wasmem: keep N allocator actions for --snapshot")
    p.add_argument("--snapshot", help="write torch.cuda.memory._dump_snapshot() here at the end")
    p.add_argument("--no-track", action="store_true", help="wasmem: do not tag kinds and phases (wasmem.torch.track)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long after each step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    if args.compare_files:
        with open(args.compare_files[0]) as a, open(args.compare_files[1]) as b:
            return finish_compare(json.load(a), json.load(b), args)
    if args.compare:
        if args.swap_at is None and not args.no_swap:
            args.swap_at = args.steps // 2
        if args.no_swap:
            args.swap_at = None
        return compare(args)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
