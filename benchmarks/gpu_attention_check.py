"""Sink-aware FlexAttention on a CUDA GPU, in one run: exactness, then time and peak memory.

1. Exactness: compiled FlexAttention (forward + backward) with the zero-value sink against the float64
   dense reference, fp32, for causal / sink + window / packed documents / GQA, at lengths that are and
   are not multiples of the 128 block; the chunked PyTorch path is checked the same way. Target: every
   relative error < 1e-5. -> ``exactness.csv``
2. Attention alone, forward + backward, bf16, batch 1, 28 heads, head dim 128, at 8k/16k/32k/64k tokens:
   sink + window FlexAttention (4 sink tokens, 4,096-key window, learnable zero-value sink) against SDPA
   causal, eager (where it fits) and FlexAttention causal. Time is the median of CUDA-event timings after
   warm-up (the first call compiles); peak memory is ``torch.cuda.max_memory_allocated`` over one
   forward + backward, inputs included. The BlockMask is built once outside the timed region (one per
   batch, shared by all layers); its build time is reported. Target: sink + window >= 2x faster than SDPA
   causal at 32k, peak memory linear in L. -> ``timing.csv``

Every row carries provenance (GPU, driver, torch, transformers, date, git sha; pass ``--git-sha`` where
the working tree has no ``.git``). Exit status 1 if any exactness case fails.

    python benchmarks/gpu_attention_check.py --out "$OUT" --git-sha <sha> --budget 240   # H200: ~3-5 min
    python benchmarks/gpu_attention_check.py --out build/gpu_attention_dry --dry-run     # CPU: tiny, ~1 min

It runs from a checkout without installing it (the GPU machine has torch and transformers, not
gymnasium, which these modules do not import). Each CSV is rewritten after every row, so a run cut short
keeps what it measured; ``--budget`` starts no timing case after that many seconds (recorded as
``skipped``). Copy the CSVs to ``data/gpu_attention/`` afterwards.

``--dry-run`` runs the same logic at toy sizes on whatever device is present (on CPU FlexAttention has
no backward, so there it checks flex forward only and times the chunked path instead of flex).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, installed or not
from sinkflex_core import attention as A  # noqa: E402

GIB = 1024**3


# ------------------------------------------------------------------------------------------ provenance
def _git_sha(arg: str | None) -> str:
    if arg:
        return arg
    if os.environ.get("SINKFLEX_GIT_SHA"):
        return os.environ["SINKFLEX_GIT_SHA"]
    try:
        from sinkflex_core.provenance import git_sha

        return git_sha()
    except Exception:
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "none"


def provenance(git_sha: str | None) -> dict:
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
        "driver": _driver() if cuda else "none",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "transformers": transformers.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git_sha": _git_sha(git_sha),
        "python": sys.version.split()[0],
    }


def write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


# ------------------------------------------------------------------------------------------ exactness
def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref.detach()).norm() / ref.detach().norm().clamp_min(1e-30))


def exactness(device: str, dry: bool, emit=None) -> list[dict]:
    # full float32 matmuls: TF32 would cost ~1e-3 relative error and say nothing about the kernels
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = [
        # name, length, heads, kv heads, n_sink, window, packed lengths
        ("causal", 1024, 8, 8, 0, None, None),
        ("sink4+window256", 1000, 8, 8, 4, 256, None),
        ("sink4+window256 gqa4", 1000, 8, 2, 4, 256, None),
        ("packed sink2+window64 gqa2", 1000, 8, 4, 2, 64, [300, 1, 450, 249]),
        ("window1 (sinks only + self)", 777, 4, 4, 4, 1, None),
    ]
    if dry:
        cases = [(n, min(length, 150), 4, kv if kv < 8 else 4, s, w and min(w, 40),
                  None if p is None else [60, 1, 50, 39]) for n, length, _, kv, s, w, p in cases]
    backends = ["flex", "chunked"]
    rows = []
    for name, n, h, hkv, n_sink, window, packed in cases:
        torch.manual_seed(0)
        d = 64 if not dry else 16
        q = torch.randn(1, h, n, d, device=device, requires_grad=True)
        k = torch.randn(1, hkv, n, d, device=device, requires_grad=True)
        v = torch.randn(1, hkv, n, d, device=device, requires_grad=True)
        s = torch.randn(h, device=device, requires_grad=True)
        pos = (torch.cat([torch.arange(x) for x in packed]) if packed else torch.arange(n))[None].to(device)
        mask = A.SinkFlexMask.from_position_ids(pos)
        kw = dict(n_sink=n_sink, window=window, sink_logits=s)
        ref = A.reference_attention(q, k, v, mask, **kw)
        g = torch.randn_like(ref)
        grads_ref = torch.autograd.grad((ref * g).sum(), (q, k, v, s))
        for backend in backends:
            row = {"case": name, "backend": backend, "length": n, "heads": h, "kv_heads": hkv, "head_dim": d,
                   "n_sink": n_sink, "window": window, "packed": "+".join(map(str, packed or [n])),
                   "dtype": "float32"}
            can_train = device == "cuda" or backend == "chunked"
            try:
                if can_train:
                    out = A.sink_attention(q, k, v, mask, backend=backend, **kw)
                    grads = torch.autograd.grad((out.double() * g).sum(), (q, k, v, s))
                else:
                    with torch.no_grad():
                        out = A.sink_attention(q, k, v, mask, backend=backend, **kw)
                    grads = [None] * 4
                row["rel_err_out"] = rel(out, ref)
                for nm, x, r in zip(("q", "k", "v", "sink"), grads, grads_ref):
                    row[f"rel_err_grad_{nm}"] = rel(x, r) if x is not None else ""
                errs = [x for kk, x in row.items() if kk.startswith("rel_err") and x != ""]
                row["pass"] = bool(max(errs) < 1e-5)
                row["note"] = "" if can_train else "forward only (no flex backward on this device)"
            except Exception as err:  # record and go on: one failing case must not hide the others
                row["pass"] = False
                row["note"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows.append(row)
            if emit is not None:
                emit(rows)
            print(f"exactness {name:30s} {backend:8s} out {row.get('rel_err_out', float('nan')):.2e} "
                  f"grads {[row.get(f'rel_err_grad_{x}', '') for x in ('q', 'k', 'v', 'sink')]} "
                  f"pass={row['pass']} {row['note']}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ timing
def eager_attention(q, k, v, scale):
    n = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v


def make_case(case: str, n: int, h: int, hkv: int, d: int, device: str, dtype, n_sink: int, window: int):
    """Returns (fn(q, k, v, sinks) -> out, setup seconds, note)."""
    scale = d**-0.5
    on_cuda = device == "cuda"
    if case == "sdpa_causal":
        return (lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                  enable_gqa=h != hkv)), 0.0, ""
    if case == "eager_causal":
        if h != hkv:
            raise ValueError("eager timing is for h == hkv")
        return (lambda q, k, v, s: eager_attention(q, k, v, scale)), 0.0, ""
    backend = "flex" if on_cuda else "chunked"
    note = "" if on_cuda else "chunked path (no flex backward on CPU)"
    t0 = time.perf_counter()
    mask = A.SinkFlexMask.causal(1, n, device=device)
    if case == "flex_causal":
        if on_cuda:
            mask.block_mask(0, None)
        setup = time.perf_counter() - t0
        return (lambda q, k, v, s: A.sink_attention(q, k, v, mask, scale=scale, backend=backend)), setup, note
    if case == "flex_sink_window":
        if on_cuda:
            mask.block_mask(n_sink, window)
            torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        return (lambda q, k, v, s: A.sink_attention(q, k, v, mask, n_sink=n_sink, window=window, sink_logits=s,
                                                    scale=scale, backend=backend)), setup, note
    raise ValueError(case)


def eager_fits(n: int, h: int, device: str) -> tuple[bool, float]:
    # scores (bf16) + probabilities (fp32 softmax, then bf16) + their gradients: ~12 bytes per entry
    need = 12.0 * h * n * n
    if device != "cuda":
        return True, need / GIB
    free, _ = torch.cuda.mem_get_info()
    return need < 0.85 * free, need / GIB


def time_case(fn, n, h, hkv, d, device, dtype, warmup: int, iters: int) -> tuple[float, float, float]:
    """(median ms, first-call s, peak GiB) of forward + backward."""
    torch.manual_seed(0)
    q = torch.randn(1, h, n, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
    s = torch.full((h,), -2.0, device=device, requires_grad=True)
    go = torch.randn(1, h, n, d, device=device, dtype=dtype)
    cuda = device == "cuda"

    def step():
        out = fn(q, k, v, s)
        out.backward(go)
        q.grad = k.grad = v.grad = s.grad = None

    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        step()
    peak = float("nan")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / GIB
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), first, peak


def timing(args, device: str, emit=None, deadline: float | None = None) -> list[dict]:
    """``deadline`` (a ``time.monotonic()`` value): cases that would start after it are recorded as
    ``skipped``; ``emit(rows)`` is called after every row."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []

    def done(row: dict) -> None:
        rows.append(row)
        if emit is not None:
            emit(rows)

    for n in args.lengths:
        for case in args.cases:
            row = {"case": case, "tokens": n, "heads": args.heads, "kv_heads": args.kv_heads,
                   "head_dim": args.head_dim, "batch": 1, "dtype": str(dtype).replace("torch.", ""),
                   "n_sink": args.n_sink if case == "flex_sink_window" else 0,
                   "window": args.window if case == "flex_sink_window" else "",
                   "zero_value_sink": case == "flex_sink_window", "measurement": "attention fwd+bwd"}
            if case == "eager_causal":
                fits, need = eager_fits(n, args.heads, device)
                if not fits:
                    row.update(status="skipped", note=f"would need ~{need:.0f} GiB for the L x L scores")
                    done(row)
                    print(f"timing {case:17s} L={n:6d} skipped ({row['note']})", flush=True)
                    continue
            if deadline is not None and time.monotonic() > deadline:
                row.update(status="skipped", note="not run: the --budget was spent")
                done(row)
                print(f"timing {case:17s} L={n:6d} skipped ({row['note']})", flush=True)
                continue
            try:
                fn, setup, note = make_case(case, n, args.heads, args.kv_heads, args.head_dim, device, dtype,
                                            args.n_sink, args.window)
                ms, first, peak = time_case(fn, n, args.heads, args.kv_heads, args.head_dim, device, dtype,
                                            args.warmup, args.iters)
                row.update(status="ok", ms=round(ms, 3), peak_gib=round(peak, 3), first_call_s=round(first, 2),
                           mask_build_s=round(setup, 4), note=note)
            except torch.cuda.OutOfMemoryError:
                row.update(status="OOM", note="torch.cuda.OutOfMemoryError")
            except Exception as err:
                row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
            if device == "cuda":
                torch.cuda.empty_cache()
            done(row)
            print(f"timing {case:17s} L={n:6d} {row['status']:7s} {row.get('ms', ''):>9} ms "
                  f"{row.get('peak_gib', ''):>7} GiB  first {row.get('first_call_s', '')} s {row.get('note', '')}",
                  flush=True)
    return rows


def summarise(rows: list[dict]) -> list[str]:
    ok = {(r["case"], r["tokens"]): r for r in rows if r.get("status") == "ok"}
    lines = []
    lengths = sorted({r["tokens"] for r in rows})
    for n in lengths:
        sw, sd = ok.get(("flex_sink_window", n)), ok.get(("sdpa_causal", n))
        if sw and sd:
            mem = sd["peak_gib"] / sw["peak_gib"] if sw["peak_gib"] == sw["peak_gib"] else float("nan")
            lines.append(f"L={n}: SDPA causal / sink+window = {sd['ms'] / sw['ms']:.2f}x time, "
                         f"{mem:.2f}x peak memory (nan: not measured on CPU)")
    sw_rows = [ok[("flex_sink_window", n)] for n in lengths if ("flex_sink_window", n) in ok]
    for a, b in zip(sw_rows, sw_rows[1:]):
        lines.append(f"sink+window L {a['tokens']}->{b['tokens']}: time x{b['ms'] / a['ms']:.2f}, "
                     f"peak x{b['peak_gib'] / a['peak_gib']:.2f} (linear in L: ~x{b['tokens'] / a['tokens']:.0f})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for exactness.csv and timing.csv")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, any device: checks the script's logic")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--cases", nargs="+", default=["sdpa_causal", "eager_causal", "flex_causal", "flex_sink_window"])
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=28)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--skip-exactness", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--git-sha", default=None, help="commit to record (default: git of the working tree)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds from the start after which no timing case starts (they are recorded as skipped)")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.dry_run and device != "cuda":
        p.error("no CUDA GPU visible: run on the GPU machine, or use --dry-run to check the script here")
    if args.dry_run:
        args.lengths = [n for n in (128, 256, 512)]
        args.heads, args.kv_heads, args.head_dim, args.window = 4, 4, 32, 64
        args.warmup, args.iters = 1, 2
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    # one static compile per shape (what the timings should measure); 13+ shapes exceed the default limit
    A.kernels.FLEX_COMPILE_DYNAMIC = False
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(args.git_sha)
    print("provenance:", prov, flush=True)
    ok = True
    if not args.skip_exactness:
        rows = exactness(device, args.dry_run,
                         emit=lambda so_far: write_csv(out / "exactness.csv", [{**r, **prov} for r in so_far]))
        ok &= all(r["pass"] for r in rows)
        print(f"exactness: {sum(r['pass'] for r in rows)}/{len(rows)} cases pass (rel err < 1e-5)", flush=True)
    if not args.skip_timing:
        deadline = None if args.budget is None else t_start + args.budget
        rows = timing(args, device, deadline=deadline, emit=lambda so_far: write_csv(
            out / "timing.csv", [{**r, **prov, "dry_run": args.dry_run} for r in so_far]))
        for line in summarise(rows):
            print(line, flush=True)
    print(f"wrote {out}/", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
