"""The VRAM comparison harness: ``sinkflex bench vram``.

One GRPO training step (the trainer's own update, see :mod:`sinkflex_core.bench.step`) of a causal LM
built from hyperparameters with random weights (nothing is downloaded), measured case by case, each
case in its own process so that one case's allocator state or out-of-memory error never touches
another:

    sinkflex bench vram --preset qwen25-7b --attention sdpa sinkflex --logprobs full chunked \\
        --mlp plain tiled --tokens 4096 8192 --cap-gib 80

A case is

- ``attention``: ``eager`` | ``sdpa`` | ``flex`` (transformers' stock ``flex_attention``) |
  ``sinkflex`` (``sinkflex_core.attention.apply``: sink tokens + window + zero-value sink);
- ``logprobs``: ``full`` (the ``(L, V)`` logits in float32, log-softmax, gather) | ``chunked``
  (``sinkflex_core.grpo.token_logprobs`` on the final hidden states);
- ``mlp``: ``plain`` | ``tiled`` (``sinkflex_core.memory.tile_mlp``);
- ``tokens``: the trajectory length L.

On a CUDA machine it records peak ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
(with ``--cap-gib`` applied through ``torch.cuda.set_per_process_memory_fraction``, so a capped run
reproduces "out of memory on an 80 GB card"); without a GPU it records the peak resident memory of the
step's process (``VmHWM``, reset after the model is built) for tiny shapes, and ``--cap-gib`` limits
the address space the step may add (RLIMIT_AS). Out-of-memory is a result, not a failure: the row
says ``oom`` and longer trajectories of the same case are skipped. Children run with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the caller sets it (less fragmentation:
it changes reserved, not allocated, memory). Rows go to ``data/vram_<gpu>.csv`` (``vram_cpu.csv``
without a GPU) with provenance columns. ``benchmarks/gpu_vram_run.sh`` is the GPU run.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .. import presets
from .step import (
    ATTENTIONS,
    COLUMNS,
    LOGPROBS,
    MLPS,
    RESULT_MARK,
    Case,
    Settings,
    _cuda_available,
    _first_line,
    _unavailable_reason,
    plan,
    run_case,
)


def _child_main(payload: str) -> int:
    spec = json.loads(payload)
    case = Case(**spec["case"])
    settings = Settings(**spec["settings"])
    try:
        row = run_case(case, settings, cap_this_process=True)
    except Exception as err:  # reported to the parent as a row, with the message
        row = {"status": "error", "note": _first_line(err, 300)}
    print(RESULT_MARK + json.dumps(row, default=float), flush=True)
    return 0


#: A case is not started with fewer seconds of the time budget left (building the model alone takes some).
MIN_CASE_S = 20.0


# The child imports the package from the same folder as this parent, installed or not (a GPU machine
# may run the harness from a plain checkout).
_CHILD_BOOTSTRAP = """
import sys
sys.path.insert(0, sys.argv[1])
from sinkflex_core.bench.vram import _child_main
sys.exit(_child_main(sys.argv[2]))
"""


def run_case_subprocess(case: Case, settings: Settings, timeout_s: float | None = None) -> dict:
    """Run one case in a fresh Python process; always returns a row (never raises for the case's
    own failures: out-of-memory, a crash, a timeout)."""
    settings = settings.resolved()
    reason = _unavailable_reason(case, settings)
    if reason:  # no process needed to find that out
        return {"status": "unavailable", "note": reason}
    spec = {"case": dataclasses.asdict(case), "settings": dataclasses.asdict(settings)}
    cmd = [sys.executable, "-c", _CHILD_BOOTSTRAP, str(Path(__file__).resolve().parents[2]), json.dumps(spec)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "note": f"no result within {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    if proc.returncode in (-9, 137):
        return {"status": "oom", "note": f"process killed (signal 9, likely the OS out-of-memory killer) {tail}"[:300]}
    return {"status": "error", "note": f"exit code {proc.returncode}: {tail}"[:300]}


def row_provenance(settings: Settings) -> dict:
    """Where and with what a row was measured: :func:`sinkflex_core.provenance.provenance` plus the
    harness's own columns (device, GPU name and driver, peft)."""
    import torch

    from ..provenance import cpu_model, hardware, provenance

    info = provenance(device=settings.device, peft=_module_version("peft"), driver="", source="sinkflex bench vram")
    info.pop("cuda", None)
    info["hardware"] = hardware(settings.device)
    if settings.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["driver"] = _nvidia_driver()
    else:
        info["gpu"] = f"cpu: {cpu_model()} ({os.cpu_count()} threads)"
    return info


def _module_version(name: str) -> str:
    try:
        return importlib.import_module(name).__version__
    except Exception:
        return ""


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def gpu_slug(settings: Settings) -> str:
    """``h200`` for "NVIDIA H200", ``cpu`` without a GPU: the ``<gpu>`` of ``data/vram_<gpu>.csv``."""
    if settings.device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def row_for(case: Case, settings: Settings, result: dict, prov: dict) -> dict:
    """A full CSV row: the case, its result and the provenance."""
    preset = presets.shape(settings.preset)
    row = dict.fromkeys(COLUMNS, "")
    row.update(prov)
    row.update(case=case.name, attention=case.attention, logprobs=case.logprobs, mlp=case.mlp, tokens=case.tokens,
               preset=preset.name, hidden=preset.hidden, layers=preset.layers, ffn=preset.ffn, vocab=preset.vocab,
               heads=preset.heads, kv_heads=preset.kv_heads, dtype=settings.dtype, finetune=settings.finetune,
               lora_r=settings.lora_r if settings.finetune == "lora" else "",
               chunk_size=settings.chunk_size if case.logprobs == "chunked" else "",
               slice_tokens=settings.slice_tokens if case.mlp == "tiled" else "",
               n_sink=settings.n_sink if case.attention == "sinkflex" else "",
               window=settings.window if case.attention == "sinkflex" else "",
               steps=settings.steps, warmup=settings.warmup,
               cap_gib=settings.cap_gib if settings.cap_gib else "", seed=settings.seed)
    for key, value in result.items():
        if key in row:
            row[key] = round(value, 4) if isinstance(value, float) else value
    return row


def run_cases(cases: list[Case], settings: Settings, out: Path | None, timeout_s: float | None = None,
              budget_s: float | None = None, skip_after_oom: bool = True, append: bool = False,
              stream=None) -> list[dict]:
    """Run ``cases`` one process each, print a line per case, append rows to ``out`` as they come
    (a run cut short keeps what it measured). Returns the rows.

    ``budget_s``: no case runs past that many seconds from the call (a case's ``timeout_s`` is cut to
    what is left, and none starts with less than :data:`MIN_CASE_S` left: those are ``skipped``).
    ``skip_after_oom``: a case that ran out of memory or timed out at some length is not run at longer
    ones (they would fail the same way, and take longer to)."""
    t_start = time.perf_counter()
    settings = settings.resolved()
    stream = stream or sys.stdout
    prov = row_provenance(settings)
    rows: list[dict] = []
    stopped_at: dict[tuple, tuple[int, str]] = {}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not append or not out.exists():
            with open(out, "w", newline="") as fh:
                csv.DictWriter(fh, COLUMNS).writeheader()
    print(f"{len(cases)} cases on {prov['gpu']} (preset {settings.preset}, {settings.dtype}, {settings.finetune}"
          f"{f', cap {settings.cap_gib} GiB' if settings.cap_gib else ''})", file=stream, flush=True)
    for i, case in enumerate(cases, 1):
        left = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
        family = (case.family, settings.finetune)
        if skip_after_oom and family in stopped_at and case.tokens > stopped_at[family][0]:
            at, why = stopped_at[family]
            result = {"status": "skipped", "note": f"not run: the same case {why} at {at} tokens"}
        elif left is not None and left < MIN_CASE_S:
            result = {"status": "skipped", "note": f"not run: time budget of {budget_s:.0f} s spent"}
        else:
            limit = min((x for x in (timeout_s, left) if x is not None), default=None)
            result = run_case_subprocess(case, settings, timeout_s=limit)
            if result.get("status") == "timeout" and (timeout_s is None or limit < timeout_s):
                result["note"] = f"{result.get('note', '')} (cut to the {limit:.0f} s left of the time budget)".strip()
            elif result.get("status") in ("oom", "timeout"):
                why = "ran out of memory" if result["status"] == "oom" else "timed out"
                if family not in stopped_at or case.tokens < stopped_at[family][0]:
                    stopped_at[family] = (case.tokens, why)
        row = row_for(case, settings, result, prov)
        rows.append(row)
        if out is not None:
            with open(out, "a", newline="") as fh:
                csv.DictWriter(fh, COLUMNS).writerow(row)
        print(f"[{i}/{len(cases)}] {describe_row(row)}", file=stream, flush=True)
    return rows


def describe_row(row: dict) -> str:
    status = row["status"]
    text = f"{row['case']:<32} {status:<11}"
    if row.get("peak_gib") not in ("", None):
        text += f" peak {float(row['peak_gib']):7.2f} GiB"
    if row.get("peak_reserved_gib") not in ("", None):
        text += f" (reserved {float(row['peak_reserved_gib']):.2f})"
    if row.get("step_s") not in ("", None):
        text += f"  step {float(row['step_s']):7.2f} s  {float(row['tokens_per_s']):9.0f} tok/s"
    if status != "ok" and row.get("note"):
        text += f"  [{row['note']}]"
    return text


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def _vram_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sinkflex bench vram",
        description="Peak memory and time of one GRPO training step, one process per case.")
    p.add_argument("--preset", default=None, choices=presets.names(),
                   help="model shape, or a training run for its model's shape (sinkflex_core.presets; "
                        "default: qwen25-7b on a GPU, tiny on CPU)")
    p.add_argument("--attention", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    p.add_argument("--logprobs", nargs="+", default=list(LOGPROBS), choices=LOGPROBS)
    p.add_argument("--mlp", nargs="+", default=list(MLPS), choices=MLPS)
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="trajectory lengths (default: 2k..128k on a GPU, 512 1024 2048 on CPU)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--finetune", default="lora", choices=["lora", "full"])
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=None, help="log-prob chunk (default: the preset's)")
    p.add_argument("--slice-tokens", type=int, default=None, help="tiled-MLP slice (default: the preset's)")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--window", type=int, default=None, help="sinkflex window (default: the preset's)")
    p.add_argument("--steps", type=int, default=1, help="measured steps per case (time: the last one)")
    p.add_argument("--warmup", type=int, default=0, help="unmeasured steps first (compilation)")
    p.add_argument("--cap-gib", type=float, default=None,
                   help="GPU: memory cap via set_per_process_memory_fraction (80 reproduces an 80 GB card); "
                        "CPU: address space the step may add (RLIMIT_AS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="CSV path (default: data/vram_<gpu>.csv); '-' for none")
    p.add_argument("--append", action="store_true", help="add rows to an existing CSV")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per case before it counts as timeout")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run: no case runs past them (its timeout is cut to what is left)")
    p.add_argument("--no-skip-after-oom", action="store_true",
                   help="run longer trajectories of a case even after a shorter one ran out of memory or timed out")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    return p


def vram_main(argv: list[str]) -> int:
    args = _vram_parser().parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if _cuda_available() else "cpu")
    if device == "cuda" and not _cuda_available():
        print("sinkflex bench vram: --device cuda but no CUDA GPU is visible; use --device cpu", file=sys.stderr)
        return 2
    preset = args.preset or ("qwen25-7b" if device == "cuda" else "tiny")
    tokens = args.tokens or ([2048, 4096, 8192, 16384, 32768, 65536, 131072] if device == "cuda"
                             else [512, 1024, 2048])
    try:
        cases = plan(args.attention, args.logprobs, args.mlp, tokens)
        settings = Settings(preset=preset, device=device, dtype=args.dtype, finetune=args.finetune,
                            lora_r=args.lora_r, chunk_size=args.chunk_size, slice_tokens=args.slice_tokens,
                            n_sink=args.n_sink, window=args.window, steps=args.steps, warmup=args.warmup,
                            cap_gib=args.cap_gib, seed=args.seed)
        if args.steps < 1 or args.warmup < 0:
            raise ValueError("--steps must be >= 1 and --warmup >= 0")
        settings = settings.resolved()
    except ValueError as err:
        print(f"sinkflex bench vram: {err}", file=sys.stderr)
        return 2
    if args.list:
        for case in cases:
            print(case.name)
        return 0
    if device == "cpu" and presets.shape(preset).hidden >= 1024:
        print(f"note: preset {preset} on CPU needs many GiB of RAM", file=sys.stderr)
    if args.out == "-":
        out = None
    elif args.out:
        out = Path(args.out)
    else:
        from ..paths import data_dir

        out = data_dir() / f"vram_{gpu_slug(settings)}.csv"
    rows = run_cases(cases, settings, out, timeout_s=args.timeout, budget_s=args.budget,
                     skip_after_oom=not args.no_skip_after_oom, append=args.append)
    if out is not None:
        print(f"{len(rows)} rows -> {out}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


