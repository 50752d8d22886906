"""CPU figures for the sink attention paths of ``sinkflex_core.attention.sink_attention``: the exact
chunked path (backend "chunked"), PyTorch's fused kernel under an additive mask (backend "fused", what
training on CPU uses at the tiny preset's lengths: blocks of ``--chunk`` queries, each against the keys
it can see; and "fused-one-mask", the same kernel in one call under the whole ``L x L`` mask, as this
backend ran before its query blocks), a dense path that builds the full ``L x L``
scores (eager attention), and stock causal SDPA without sinks or window (a different attention, shown
as the speed to match): forward + backward time and peak memory against length.

Each case runs in fresh subprocesses: one times it (median of 3 after a warm-up call), one measures its
peak resident memory (``VmHWM``) above the inputs. With a sliding window the chunked path's memory grows linearly in L (each
query chunk sees at most chunk + window + sinks keys) while the dense path's grows as L^2.

    python benchmarks/bench_attention.py                 # L = 1k .. 8k (dense) / 16k (chunked), minutes
    python benchmarks/bench_attention.py --quick         # L = 512 .. 2k, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 1024**2


def rss_bytes() -> int:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_case(mode: str, path: str, n: int, heads: int, head_dim: int, n_sink: int, window: int, chunk: int,
             threads: int) -> dict:
    import torch

    from sinkflex_core import attention as A

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q = torch.randn(1, heads, n, head_dim, requires_grad=True)
    k = torch.randn(1, heads, n, head_dim, requires_grad=True)
    v = torch.randn(1, heads, n, head_dim, requires_grad=True)
    s = torch.full((heads,), -2.0, requires_grad=True)
    go = torch.randn(1, heads, n, head_dim)
    mask = A.SinkFlexMask.causal(1, n)

    def dense():
        scores = (q @ k.transpose(-1, -2)) * head_dim**-0.5
        allowed = mask.dense(n_sink, window)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        col = s.view(1, -1, 1, 1).expand(1, heads, n, 1)
        p = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
        return p @ v

    def chunked():
        return A.sink_attention(q, k, v, mask, n_sink=n_sink, window=window, sink_logits=s, chunk_size=chunk,
                                backend="chunked")

    def fused():
        return A.sink_attention(q, k, v, mask, n_sink=n_sink, window=window, sink_logits=s, chunk_size=chunk,
                                backend="fused")

    def fused_one_mask():
        return A.sink_attention(q, k, v, mask, n_sink=n_sink, window=window, sink_logits=s, chunk_size=n,
                                backend="fused")

    def sdpa_causal():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fn = {"dense": dense, "chunked": chunked, "fused": fused, "fused-one-mask": fused_one_mask,
          "sdpa-causal": sdpa_causal}[path]

    def step():
        fn().backward(go)
        q.grad = k.grad = v.grad = s.grad = None

    step()  # untimed: lazy initialisation would otherwise dominate the small cases
    if mode == "time":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return {"seconds": sorted(times)[1]}
    base = rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    return {"peak_above_inputs_mib": (peak_rss_bytes() - base) / MIB}


def print_ratios(title: str, results: dict, lengths: list[int], slow: str, fast: str) -> None:
    """Time and memory of path ``slow`` over path ``fast`` at each length both ran."""
    print(title)
    for n in lengths:
        a, b = results.get((slow, n)), results.get((fast, n))
        if a and b:
            print(f"  L={n:6d}: time x{a['seconds'] / b['seconds']:.2f}, "
                  f"memory x{a['peak_above_inputs_mib'] / max(b['peak_above_inputs_mib'], 1e-9):.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    # one thread by default: on a busy machine OpenMP's spinning threads slow the chunked path's many
    # small kernels far more than the dense path's few large ones, which would make the ratio meaningless
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: one case in this process
    args = p.parse_args(argv)
    if args.case:
        mode, path, n = args.case.split(":")
        print(json.dumps(run_case(mode, path, int(n), args.heads, args.head_dim, args.n_sink, args.window,
                                  args.chunk, args.threads)))
        return 0
    dense_lengths = [512, 1024, 2048] if args.quick else [1024, 2048, 4096, 8192]
    chunked_lengths = dense_lengths + ([] if args.quick else [16384])
    window = min(args.window, 256) if args.quick else args.window
    print(f"attention fwd+bwd on CPU, float32, batch 1, {args.heads} heads, head dim {args.head_dim}, "
          f"{args.n_sink} sinks + window {window}, zero-value sink; chunk {args.chunk} queries; "
          f"{args.threads} thread(s)")
    results = {}
    for path, lengths in (("chunked", chunked_lengths), ("fused", dense_lengths), ("fused-one-mask", dense_lengths),
                          ("dense", dense_lengths), ("sdpa-causal", dense_lengths)):
        for n in lengths:
            r = {}
            for mode in ("time", "memory"):
                cmd = [sys.executable, __file__, "--case", f"{mode}:{path}:{n}", "--heads", str(args.heads),
                       "--head-dim", str(args.head_dim), "--n-sink", str(args.n_sink), "--window", str(window),
                       "--chunk", str(args.chunk), "--threads", str(args.threads)]
                env = dict(os.environ)
                if mode == "memory":
                    # a fixed mmap threshold makes glibc return every freed tensor to the OS, so that the RSS
                    # after the warm-up call is a fair baseline; it slows allocation, hence a separate process
                    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    print(f"{path:14s} L={n:6d} {mode} failed: {out.stderr.strip().splitlines()[-1:]}")
                    break
                r.update(json.loads(out.stdout.strip().splitlines()[-1]))
            if len(r) < 2:
                continue
            results[(path, n)] = r
            print(f"{path:14s} L={n:6d}  {r['seconds']:8.3f} s  peak above inputs {r['peak_above_inputs_mib']:9.1f} MiB",
                  flush=True)
    print()
    print_ratios("ratios dense / chunked (time, memory):", results, dense_lengths, "dense", "chunked")
    print("time chunked / fused, and fused / stock causal SDPA (no sinks, no window):")
    for n in dense_lengths:
        c, f, d = results.get(("chunked", n)), results.get(("fused", n)), results.get(("sdpa-causal", n))
        if c and f:
            print(f"  L={n:6d}: chunked / fused x{c['seconds'] / f['seconds']:.2f}"
                  + (f", fused / sdpa-causal x{f['seconds'] / d['seconds']:.2f}" if d else ""))
    print_ratios("the fused kernel in one call under the whole mask / in query blocks (time, memory):", results,
                 dense_lengths, "fused-one-mask", "fused")
    print("growth of the chunked path's memory when L doubles (linear: ~x2):")
    for a, b in zip(chunked_lengths, chunked_lengths[1:]):
        ca, cb = results.get(("chunked", a)), results.get(("chunked", b))
        if ca and cb:
            print(f"  {a} -> {b}: x{cb['peak_above_inputs_mib'] / max(ca['peak_above_inputs_mib'], 1e-9):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
