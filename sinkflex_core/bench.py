"""The VRAM comparison harness: ``sinkflex bench vram``.

One GRPO training step of a causal LM built from hyperparameters with random weights (nothing is
downloaded), measured case by case, each case in its own process so that one case's allocator state
or out-of-memory error never touches another:

    sinkflex bench vram --preset qwen25-7b --attention sdpa sinkflex --logprobs full chunked \\
        --mlp plain tiled --tokens 4096 8192 --cap-gib 80

The step (the same for every case): reference log-probs under ``no_grad`` (LoRA adapters disabled,
the base model), then the policy forward + backward with the GRPO loss (clipped ratio against the
sampling log-probs, k3 KL to the reference, token-mean over the policy tokens), then an AdamW step;
gradient checkpointing, batch 1. A case is

- ``attention``: ``eager`` | ``sdpa`` | ``flex`` (transformers' stock ``flex_attention``) |
  ``sinkflex`` (``sinkflex_core.attention.apply``: sink tokens + window + zero-value sink);
- ``logprobs``: ``full`` (the ``(L, V)`` logits, upcast, log-softmax, gather) | ``chunked``
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

The second half of this module reads those CSVs for the notebooks: the paper's claims
(``data/paper_claims.csv``), the memory-vs-length plot and the claim-vs-measurement table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import glob
import importlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ATTENTIONS = ("eager", "sdpa", "flex", "sinkflex")
LOGPROBS = ("full", "chunked")
MLPS = ("plain", "tiled")
STATUSES = ("ok", "oom", "unavailable", "error", "timeout", "skipped")
RESULT_MARK = "SINKFLEX_BENCH_RESULT "
GIB = 2**30

# Columns of data/vram_*.csv, in order. Measurements first, then the case, then provenance.
COLUMNS = [
    "case", "attention", "logprobs", "mlp", "tokens", "status",
    "peak_gib", "memory_metric", "peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib", "base_gib",
    "step_s", "first_step_s", "tokens_per_s", "loss",
    "preset", "hidden", "layers", "ffn", "vocab", "heads", "kv_heads", "dtype", "finetune", "lora_r",
    "chunk_size", "slice_tokens", "n_sink", "window", "steps", "warmup", "cap_gib", "seed",
    "device", "gpu", "hardware", "driver", "torch", "transformers", "peft", "python", "date", "git_sha", "source", "note",
]


# ----------------------------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Preset:
    """A model shape and the settings that suit it."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    chunk_size: int  # log-prob chunk (tokens)
    slice_tokens: int  # tiled-MLP slice (tokens)
    window: int  # sinkflex window (keys)


PRESETS = {
    # Qwen2.5-7B's published hyperparameters (its config.json on the Hugging Face Hub).
    "qwen25-7b": Preset("qwen25-7b", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064,
                        chunk_size=2048, slice_tokens=8192, window=4096),
    # A CPU-sized stand-in with the same proportions where they matter for memory: vocabulary large
    # against hidden (logits dominate), FFN ~5x hidden, grouped KV heads.
    "tiny": Preset("tiny", hidden=256, layers=4, heads=4, kv_heads=2, ffn=1344, vocab=16384,
                   chunk_size=256, slice_tokens=512, window=256),
    # Smaller GPU shape for full fine-tuning (weights + grads + AdamW states fit under 80 GiB).
    "qwen25-1.5b": Preset("qwen25-1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960,
                          vocab=151936, chunk_size=2048, slice_tokens=8192, window=4096),
}


def qwen2_config(preset: Preset, max_tokens: int = 32768):
    """A transformers ``Qwen2Config`` for ``preset``. The 7B shape comes from
    ``sinkflex_core.models.qwen25_7b_config`` when that exists, so the whole project uses one."""
    from transformers import Qwen2Config

    config = None
    if preset.name == "qwen25-7b":
        try:
            config = importlib.import_module("sinkflex_core.models").qwen25_7b_config()
        except (ImportError, AttributeError):
            config = None
    if config is None:
        config = Qwen2Config(
            vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.ffn,
            num_hidden_layers=preset.layers, num_attention_heads=preset.heads,
            num_key_value_heads=preset.kv_heads, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            max_position_embeddings=32768, use_sliding_window=False,
        )
    config.max_position_embeddings = max(int(config.max_position_embeddings), int(max_tokens))
    config.use_cache = False
    return config


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    attention: str
    logprobs: str
    mlp: str
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.attention}/{self.logprobs}/{self.mlp}/{self.tokens}"

    @property
    def family(self) -> tuple[str, str, str]:
        return (self.attention, self.logprobs, self.mlp)


@dataclass
class Settings:
    """Everything about a run that is not the case itself."""

    preset: str = "tiny"
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32
    finetune: str = "lora"  # lora | full
    lora_r: int = 16
    chunk_size: int | None = None
    slice_tokens: int | None = None
    n_sink: int = 4
    window: int | None = None
    steps: int = 1
    warmup: int = 0
    cap_gib: float | None = None
    seed: int = 0
    kl_coef: float = 0.04
    extra: dict = field(default_factory=dict)

    def resolved(self) -> Settings:
        """A copy with ``auto`` and ``None`` replaced by the preset's and machine's values."""
        preset = get_preset(self.preset)
        device = self.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        dtype = self.dtype if self.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
        return dataclasses.replace(
            self, device=device, dtype=dtype,
            chunk_size=self.chunk_size or preset.chunk_size,
            slice_tokens=self.slice_tokens or preset.slice_tokens,
            window=self.window or preset.window,
        )


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _unavailable_reason(case: Case, settings: Settings) -> str | None:
    """Why a case cannot run on this machine / in this checkout, or None if it can."""
    if case.attention == "flex" and settings.device == "cpu":
        return "FlexAttention has no backward on CPU (torch raises NotImplementedError)"
    needed = []  # (module, function) the case calls
    if case.attention == "sinkflex":
        needed.append(("sinkflex_core.attention", "apply"))
    if case.logprobs == "chunked":
        needed.append(("sinkflex_core.grpo", "token_logprobs"))
    for module, name in needed:
        try:
            mod = importlib.import_module(module)
        except ImportError as err:
            return f"{module} not importable ({err})"
        if not callable(getattr(mod, name, None)):
            return f"{module}.{name} is missing"
    return None


class _Memory:
    """Peak memory of the step: CUDA allocator statistics, or the process's resident-set high-water
    mark (``VmHWM``, which Linux resets when ``5`` is written to ``/proc/self/clear_refs``)."""

    def __init__(self, device: str):
        self.device = device

    def reset(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
            except OSError:  # not Linux: ru_maxrss (peak since start) is then all there is
                pass

    def current_gib(self) -> float:
        import torch

        if self.device == "cuda":
            return torch.cuda.memory_allocated() / GIB
        return _proc_status_kib("VmRSS") / 2**20

    def peaks(self) -> dict:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            alloc = torch.cuda.max_memory_allocated() / GIB
            return {"peak_gib": alloc, "memory_metric": "cuda_max_allocated", "peak_allocated_gib": alloc,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
        hwm = _proc_status_kib("VmHWM")
        if hwm <= 0:
            import resource

            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        rss = hwm / 2**20
        return {"peak_gib": rss, "memory_metric": "cpu_peak_rss", "peak_rss_gib": rss}


def _proc_status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def build_policy(case: Case, settings: Settings):
    """The model of one case, ready to train: ``(model, causal_lm)`` where ``model`` is what the
    optimizer trains (a peft model for LoRA) and ``causal_lm`` the transformers model inside it."""
    import torch
    from transformers import AutoModelForCausalLM

    preset = get_preset(settings.preset)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[settings.dtype]
    config = qwen2_config(preset, max_tokens=case.tokens)
    impl = {"eager": "eager", "sdpa": "sdpa", "flex": "flex_attention", "sinkflex": "sdpa"}[case.attention]
    torch.manual_seed(settings.seed)
    with torch.device(settings.device):
        causal_lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)
    if case.attention == "sinkflex":
        attention = importlib.import_module("sinkflex_core.attention")
        attention.apply(causal_lm, n_sink=settings.n_sink, window=settings.window, learn_sinks=True)
        causal_lm.to(settings.device)
    if case.mlp == "tiled":
        from .memory import tile_mlp

        tile_mlp(causal_lm, slice_tokens=settings.slice_tokens)
    causal_lm.config.use_cache = False
    causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = causal_lm
    if settings.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=settings.lora_r, lora_alpha=2 * settings.lora_r, lora_dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        model = get_peft_model(causal_lm, lora)
        # The learnable sink logits are trained with the adapters (peft froze every base parameter).
        for name, param in causal_lm.named_parameters():
            if "sink" in name.lower():
                param.requires_grad_(True)
    elif settings.finetune != "full":
        raise ValueError(f"finetune must be 'lora' or 'full', got {settings.finetune!r}")
    model.train()
    return model, causal_lm


def sequence_logprobs(model, causal_lm, input_ids, logprobs: str, chunk_size: int):
    """Log-prob of each next token: ``input_ids`` (B, L) -> (B, L-1), entry t being
    log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    ``full`` builds the ``(B, L, V)`` logits and log-softmaxes them in float32 (the standard way);
    ``chunked`` hands the final hidden states to ``sinkflex_core.grpo.token_logprobs``."""
    import torch

    labels = input_ids[:, 1:]
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
    if logprobs == "full":
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if logprobs != "chunked":
        raise ValueError(f"logprobs must be one of {LOGPROBS}, got {logprobs!r}")
    token_logprobs = importlib.import_module("sinkflex_core.grpo").token_logprobs
    hidden = causal_lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    weight = causal_lm.get_output_embeddings().weight
    out = token_logprobs(hidden[:, :-1], weight, labels, chunk_size=chunk_size)
    return out[0] if isinstance(out, tuple) else out


def grpo_step(model, causal_lm, optimizer, input_ids, loss_mask, advantages, logprobs: str, chunk_size: int,
              kl_coef: float = 0.04, clip_low: float = 0.2, clip_high: float = 0.28):
    """One GRPO update on one batch; returns the loss (a float).

    ``input_ids`` (B, L) long; ``loss_mask`` (B, L-1) float, 1 where the predicted token is the
    policy's; ``advantages`` (B,). Reference log-probs come first, under no_grad, from the base model
    (LoRA adapters disabled; with full fine-tuning the same weights stand in for a frozen copy, which
    changes no activation memory). The sampling log-probs equal them (the first update of a batch)."""
    import contextlib

    import torch

    disable = getattr(model, "disable_adapter", None)
    with torch.no_grad(), (disable() if disable else contextlib.nullcontext()):
        ref_logp = sequence_logprobs(model, causal_lm, input_ids, logprobs, chunk_size)
    old_logp = ref_logp
    logp = sequence_logprobs(model, causal_lm, input_ids, logprobs, chunk_size)
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    adv = advantages[:, None]
    policy = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))
    log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)
    kl = torch.exp(log_ratio) - log_ratio - 1.0  # k3
    loss = ((policy + kl_coef * kl) * loss_mask).sum() / loss_mask.sum().clamp_min(1.0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def step_inputs(tokens: int, vocab: int, device: str, seed: int):
    """Random token ids (1, L), a loss mask (1, L-1) with the first eighth (the prompt) masked out,
    and advantage +1 (as if the trajectory beat its group)."""
    import torch

    if tokens < 2:
        raise ValueError(f"a trajectory needs at least 2 tokens, got {tokens}")
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
    loss_mask = torch.ones(1, tokens - 1, device=device)
    loss_mask[:, : max(1, tokens // 8)] = 0.0
    advantages = torch.ones(1, device=device)
    return input_ids, loss_mask, advantages


def run_case(case: Case, settings: Settings, cap_this_process: bool = False) -> dict:
    """Run one case in this process and return its measurements (a dict of CSV columns).

    Out-of-memory gives ``status="oom"`` (with the peak reached before it); a case that cannot run
    here gives ``status="unavailable"`` and the reason in ``note``. ``settings.cap_gib`` applies on
    CPU only with ``cap_this_process`` (it limits the whole process for the rest of its life, which
    suits the per-case child, not a caller that goes on)."""
    import torch

    settings = settings.resolved()
    row = {"status": "ok", "note": ""}
    reason = _unavailable_reason(case, settings)
    if reason:
        return {"status": "unavailable", "note": reason}
    if settings.device == "cuda":
        if not torch.cuda.is_available():
            return {"status": "unavailable", "note": "no CUDA GPU visible"}
        if settings.cap_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, settings.cap_gib * GIB / total))
    memory = _Memory(settings.device)
    oom_types = (torch.OutOfMemoryError, MemoryError)
    try:
        model, causal_lm = build_policy(case, settings)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        preset = get_preset(settings.preset)
        input_ids, loss_mask, advantages = step_inputs(case.tokens, preset.vocab, settings.device, settings.seed)
        row["base_gib"] = memory.current_gib()
        if settings.device == "cpu" and settings.cap_gib and cap_this_process:
            _cap_cpu_address_space(settings.cap_gib)
        times = []
        for i in range(settings.warmup + settings.steps):
            if i == settings.warmup:
                memory.reset()  # warm-up steps (compilation, allocator growth) are not measured
            _sync(settings.device)
            t0 = time.perf_counter()
            row["loss"] = grpo_step(model, causal_lm, optimizer, input_ids, loss_mask, advantages,
                                    case.logprobs, settings.chunk_size, kl_coef=settings.kl_coef)
            _sync(settings.device)
            times.append(time.perf_counter() - t0)
        row.update(memory.peaks())
        row["first_step_s"] = times[0]
        row["step_s"] = times[-1]
        row["tokens_per_s"] = case.tokens / times[-1]
    except oom_types as err:
        row.update(memory.peaks())
        row.update(status="oom", note=_first_line(err))
    except RuntimeError as err:
        # CPU allocations refused by an address-space cap surface as RuntimeError.
        if "allocate" in str(err).lower() or "out of memory" in str(err).lower():
            row.update(memory.peaks())
            row.update(status="oom", note=_first_line(err))
        else:
            raise
    return row


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text[:limit]


def _cap_cpu_address_space(cap_gib: float) -> None:
    """On CPU, ``--cap-gib`` limits the address space the step may add to what the process maps
    once the model is built (RLIMIT_AS), so an over-large step fails to allocate: the CPU analogue
    of the CUDA cap (which also counts the weights), used to exercise the out-of-memory path anywhere."""
    import resource

    current = _proc_status_kib("VmSize") * 1024
    limit = int(current + cap_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


# ----------------------------------------------------------------------------------------------
# Running many cases, each in its own process
# ----------------------------------------------------------------------------------------------

def plan(attentions, logprobs, mlps, tokens) -> list[Case]:
    """Every combination, grouped by case family, shortest trajectory first (so that an
    out-of-memory at one length can skip the longer ones)."""
    for name, values, allowed in (("attention", attentions, ATTENTIONS), ("logprobs", logprobs, LOGPROBS),
                                  ("mlp", mlps, MLPS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")
    if not tokens or any(int(t) < 2 for t in tokens):
        raise ValueError(f"tokens must be integers >= 2, got {tokens}")
    return [Case(a, lp, m, int(t)) for a in attentions for lp in logprobs for m in mlps
            for t in sorted(set(int(t) for t in tokens))]


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


# The child imports the package from the same folder as this parent, installed or not (a GPU machine
# may run the harness from a plain checkout).
_CHILD_BOOTSTRAP = """
import sys
sys.path.insert(0, sys.argv[1])
from sinkflex_core.bench import _child_main
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
    cmd = [sys.executable, "-c", _CHILD_BOOTSTRAP, str(Path(__file__).resolve().parents[1]), json.dumps(spec)]
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


def provenance(settings: Settings) -> dict:
    """Where and with what a row was measured."""
    import torch

    info = {"device": settings.device, "torch": torch.__version__, "python": platform.python_version(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "git_sha": git_sha(),
            "transformers": _module_version("transformers"), "peft": _module_version("peft"),
            "driver": "", "source": "sinkflex bench vram"}
    if settings.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["hardware"] = f"cuda:{info['gpu']}"
        info["driver"] = _nvidia_driver()
    else:
        info["gpu"] = f"cpu: {_cpu_model()} ({os.cpu_count()} threads)"
        info["hardware"] = f"cpu:{_cpu_model()} x{torch.get_num_threads()}"
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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_sha() -> str:
    """The checkout's commit (``+dirty`` when files differ from it); ``SINKFLEX_GIT_SHA`` when set
    (a copied tree without ``.git``); ``unknown`` otherwise."""
    if os.environ.get("SINKFLEX_GIT_SHA"):
        return os.environ["SINKFLEX_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_slug(settings: Settings) -> str:
    """``h200`` for "NVIDIA H200", ``cpu`` without a GPU: the ``<gpu>`` of ``data/vram_<gpu>.csv``."""
    if settings.device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def row_for(case: Case, settings: Settings, result: dict, prov: dict) -> dict:
    """A full CSV row: the case, its result and the provenance."""
    preset = get_preset(settings.preset)
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
    (a run cut short keeps what it measured). Returns the rows."""
    settings = settings.resolved()
    stream = stream or sys.stdout
    prov = provenance(settings)
    rows: list[dict] = []
    out_of_memory_at: dict[tuple, int] = {}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not append or not out.exists():
            with open(out, "w", newline="") as fh:
                csv.DictWriter(fh, COLUMNS).writeheader()
    t_start = time.perf_counter()
    print(f"{len(cases)} cases on {prov['gpu']} (preset {settings.preset}, {settings.dtype}, {settings.finetune}"
          f"{f', cap {settings.cap_gib} GiB' if settings.cap_gib else ''})", file=stream, flush=True)
    for i, case in enumerate(cases, 1):
        elapsed = time.perf_counter() - t_start
        family = (case.family, settings.finetune)
        if skip_after_oom and family in out_of_memory_at and case.tokens > out_of_memory_at[family]:
            result = {"status": "skipped",
                      "note": f"not run: the same case ran out of memory at {out_of_memory_at[family]} tokens"}
        elif budget_s is not None and elapsed > budget_s:
            result = {"status": "skipped", "note": f"not run: time budget of {budget_s:.0f} s spent"}
        else:
            result = run_case_subprocess(case, settings, timeout_s=timeout_s)
        if result.get("status") == "oom":
            out_of_memory_at[family] = min(case.tokens, out_of_memory_at.get(family, case.tokens))
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
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="model shape (default: qwen25-7b on a GPU, tiny on CPU)")
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
    p.add_argument("--budget", type=float, default=None, help="start no new case after this many seconds")
    p.add_argument("--no-skip-after-oom", action="store_true",
                   help="run longer trajectories of a case even after a shorter one ran out of memory")
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
    if device == "cpu" and preset != "tiny":
        print(f"note: preset {preset} on CPU needs many GiB of RAM", file=sys.stderr)
    if args.out == "-":
        out = None
    elif args.out:
        out = Path(args.out)
    else:
        from .paths import data_dir

        out = data_dir() / f"vram_{gpu_slug(settings)}.csv"
    rows = run_cases(cases, settings, out, timeout_s=args.timeout, budget_s=args.budget,
                     skip_after_oom=not args.no_skip_after_oom, append=args.append)
    if out is not None:
        print(f"{len(rows)} rows -> {out}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """``sinkflex bench <what> ...``; ``what`` is ``vram`` or ``results``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_case":  # the per-case child process
        return _child_main(argv[1])
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: sinkflex bench vram [options]      (sinkflex bench vram --help for the options)\n"
              "       sinkflex bench results [--readme README.md]   (the paper's claims beside ours)")
        return 0 if argv else 2
    if argv[0] == "results":
        return results_main(argv[1:])
    if argv[0] != "vram":
        print(f"sinkflex bench: unknown command {argv[0]!r}; available: vram, results", file=sys.stderr)
        return 2
    return vram_main(argv[1:])


# ----------------------------------------------------------------------------------------------
# Reading results: the notebooks' side
# ----------------------------------------------------------------------------------------------

def load_vram_results(folder: Path | None = None):
    """Every ``data/vram_*.csv`` as one DataFrame, with ``file`` (its name) and ``recorded`` (True for
    the transcribed ``vram_recorded_*.csv`` measurements) columns; empty if there is none."""
    import pandas as pd

    from .paths import data_dir

    folder = Path(folder) if folder else data_dir()
    frames = []
    for path in sorted(folder.glob("vram_*.csv")):
        df = pd.read_csv(path)
        if df.empty:
            continue
        df["file"] = path.name
        df["recorded"] = path.name.startswith("vram_recorded")
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=[*COLUMNS, "file", "recorded"])
    df = pd.concat(frames, ignore_index=True)
    for col in ("tokens", "peak_gib", "step_s", "tokens_per_s", "peak_reserved_gib"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    return df


def load_paper_claims(folder: Path | None = None):
    """``data/paper_claims.csv`` as a DataFrame (empty if missing)."""
    import pandas as pd

    from .paths import data_dir

    path = (Path(folder) if folder else data_dir()) / "paper_claims.csv"
    return pd.read_csv(path) if path.exists() else pd.DataFrame()


def case_label(row) -> str:
    label = f"{row['attention']} · {row['logprobs']} logprobs · {row['mlp']} mlp"
    if "recorded" in row and bool(row["recorded"]):
        label += " (recorded)"
    return label


def plot_peak_vs_length(results, paper=None, cap_gib: float | None = 80.0, ax=None, title: str | None = None):
    """Peak memory against trajectory length, one line per case (attention x log-probs x MLP;
    dashed: recorded), out-of-memory marked with an x above the ``cap_gib`` line at the length where
    it happened, and the paper's points (``paper``: rows of ``load_paper_claims`` with
    ``quantity == 'peak_vram'``; its OOM as a labelled arrow). Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 5.5))
    top = cap_gib or 80.0
    oom_y = top * 1.06
    if results is not None and len(results):
        results = results[results["tokens"].notna()]
        top = max(top, float(pd_numeric(results["peak_gib"]).max() if len(results) else 0.0))
        oom_y = top * 1.06
        for label, grp in results.groupby(results.apply(case_label, axis=1), sort=True):
            grp = grp.sort_values("tokens")
            ok = grp[grp["status"] == "ok"]
            style = "--" if "(recorded)" in label else "-"
            (line,) = ax.plot(ok["tokens"], ok["peak_gib"], style, marker="o", ms=4, label=label)
            oom = grp[grp["status"] == "oom"]
            if len(oom):
                ax.plot(oom["tokens"], [oom_y] * len(oom), "x", ms=10, mew=2, color=line.get_color())
    if paper is not None and len(paper):
        vram = paper[paper["quantity"] == "peak_vram"]
        for _, p in vram[vram["value"].notna()].iterrows():
            standard = "standard" in str(p["setting"])
            ax.plot(p["tokens"], p["value"], "s" if standard else "*", ms=11, color="black",
                    mfc="none" if standard else "black", label=f"paper: {p['setting']} at {int(p['tokens'])}")
        for _, p in vram[vram["value"].isna()].iterrows():
            ax.annotate(f"paper: {p['setting']} OOM", (p["tokens"], oom_y), xytext=(p["tokens"], oom_y * 0.9),
                        ha="center", fontsize=8, arrowprops={"arrowstyle": "->"})
    if cap_gib:
        ax.axhline(cap_gib, color="red", lw=1, ls=":", label=f"{cap_gib:g} GiB (an 80 GB card)")
    ax.plot([], [], "x", color="gray", mew=2, label="out of memory")
    ax.set_ylim(0, oom_y * 1.08)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("trajectory length (tokens)")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(title or "Peak memory of one GRPO step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return ax


def ratio_table(results, paper):
    """For each measured case at each length where the paper has a point, our peak and the ratio
    to the paper's standard and SINKFLEX numbers. Columns: case, tokens, ours_gib, paper_standard,
    paper_sinkflex, vs_standard, vs_sinkflex, source."""
    import pandas as pd

    rows = []
    if results is None or not len(results) or paper is None or not len(paper):
        return pd.DataFrame(rows)
    vram = paper[paper["quantity"] == "peak_vram"]
    for tokens, grp in vram.groupby("tokens"):
        std = grp[grp["setting"].str.contains("standard")]["value"]
        snk = grp[grp["setting"].str.contains("SINKFLEX")]["value"]
        std = float(std.iloc[0]) if len(std) and pd.notna(std.iloc[0]) else math.nan
        snk = float(snk.iloc[0]) if len(snk) and pd.notna(snk.iloc[0]) else math.nan
        ours = results[(results["tokens"] == tokens) & (results["status"] == "ok")]
        for _, r in ours.iterrows():
            rows.append({"case": case_label(r), "tokens": int(tokens), "ours_gib": round(r["peak_gib"], 2),
                         "paper_standard": std, "paper_sinkflex": snk,
                         "vs_standard": round(r["peak_gib"] / std, 3) if std == std else math.nan,
                         "vs_sinkflex": round(r["peak_gib"] / snk, 3) if snk == snk else math.nan,
                         "source": r["file"]})
    return pd.DataFrame(rows)


def _match_measurement(claim, folder: Path):
    """Our number for one paper claim, found as the claim row says (``match_files``: globs under
    ``data/``, first file that matches wins; ``match_query``: a pandas query; ``match_column``).
    Returns ``(value, hardware, file)`` or None."""
    import pandas as pd

    files = str(claim.get("match_files", "") or "")
    query = str(claim.get("match_query", "") or "")
    column = str(claim.get("match_column", "") or "")
    if not files or files == "nan" or not column or column == "nan":
        return None
    for pattern in files.split(";"):
        for path in sorted(glob.glob(str(folder / pattern.strip()))):
            try:
                df = pd.read_csv(path)
                if column in df:  # e.g. evaluation rows only, before "step == step.max()"
                    df = df[df[column].notna()]
                if query and query != "nan":
                    df = df.query(query)
            except Exception:  # a file of another shape: not the one this claim is about
                continue
            if column == "status_oom":
                if len(df):
                    r = df.iloc[0]
                    value = "OOM" if r["status"] in ("oom", "skipped") else f"fits ({float(r['peak_gib']):.2f} GiB)"
                    return value, str(r.get("gpu", "")), Path(path).name
                continue
            if column not in df or not len(df):
                continue
            values = pd.to_numeric(df[column], errors="coerce").dropna()
            if len(values):
                hw = str(df["gpu"].iloc[0]) if "gpu" in df else str(df.get("hardware", pd.Series([""])).iloc[0])
                return float(values.mean()), hw, Path(path).name
    return None


def paper_vs_ours(folder: Path | None = None):
    """The side-by-side table: each claim of ``data/paper_claims.csv``, our measurement from
    ``data/`` ("not measured yet" where nothing matches), the hardware, and the gap.

    A claim whose ``match_column`` is ``ratio:A/B`` is the relative change from claim A's
    measurement to claim B's (in %), and one with ``diff:A/B`` the difference B - A, both computed
    from our two numbers."""
    import pandas as pd

    from .paths import data_dir

    folder = Path(folder) if folder else data_dir()
    claims = load_paper_claims(folder)
    found_by_id: dict[str, tuple] = {}
    rows = []
    for _, c in claims.iterrows():
        column = str(c.get("match_column", "") or "")
        kind, _, pair = column.partition(":")
        if kind in ("ratio", "diff") and pair:
            a, b = pair.split("/")
            if a in found_by_id and b in found_by_id and not isinstance(found_by_id[a][0], str) \
                    and not isinstance(found_by_id[b][0], str):
                va, vb = found_by_id[a][0], found_by_id[b][0]
                change = 100.0 * (vb / va - 1.0) if kind == "ratio" else vb - va
                files = found_by_id[a][2] if found_by_id[a][2] == found_by_id[b][2] \
                    else f"{found_by_id[a][2]} + {found_by_id[b][2]}"
                found = (change, found_by_id[b][1], files)
            else:
                found = None
        else:
            found = _match_measurement(c, folder)
        if found:
            found_by_id[str(c["claim_id"])] = found
        paper_oom = pd.isna(c["value"])
        unit = str(c["unit"]) if pd.notna(c["unit"]) else ""
        row = {"claim": c["claim"], "paper": "OOM" if paper_oom else f"{c['value']:g} {unit}".strip(),
               "paper_hardware": c["hardware"], "ours": "not measured yet", "our_hardware": "", "gap": "",
               "from": ""}
        if found:
            value, hw, fname = found
            row.update(our_hardware=hw, **{"from": fname})
            if isinstance(value, str):
                row["ours"] = value
                row["gap"] = "same outcome" if (value == "OOM") == paper_oom else "differs: paper OOM, ours fits"
            else:
                our_unit = str(c.get("our_unit", "") or "")
                sign = "+" if kind == "diff" else ""
                row["ours"] = f"{value:{sign}.2f} {our_unit if our_unit != 'nan' else ''}".strip()
                if paper_oom:
                    row["gap"] = "paper: OOM; ours fits"
                elif unit == "%":
                    row["gap"] = f"{value - float(c['value']):+.1f} points"
                else:
                    gap = value - float(c["value"])
                    row["gap"] = f"{gap:+.2f} ({value / float(c['value']) - 1:+.1%})"
        rows.append(row)
    return pd.DataFrame(rows)


RESULTS_BEGIN = "<!-- results: made by `sinkflex bench results --readme README.md`; do not edit by hand -->"
RESULTS_END = "<!-- results: end -->"


def results_markdown(folder: Path | None = None) -> str:
    """:func:`paper_vs_ours` as a Markdown table (the README's "Results" block)."""
    table = paper_vs_ours(folder)
    lines = ["| claim | paper | ours | gap | our hardware | data |", "|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        cells = [r["claim"], f"{r['paper']} ({r['paper_hardware']})", r["ours"], r["gap"], r["our_hardware"],
                 f"`{r['from']}`" if r["from"] else ""]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def readme_with_results(text: str, folder: Path | None = None) -> str:
    """``text`` (a README) with the lines between :data:`RESULTS_BEGIN` and :data:`RESULTS_END`
    replaced by :func:`results_markdown`; ValueError if the markers are missing."""
    start, end = text.find(RESULTS_BEGIN), text.find(RESULTS_END)
    if start < 0 or end < start:
        raise ValueError(f"no results block: put the lines {RESULTS_BEGIN!r} and {RESULTS_END!r} where the "
                         "table goes")
    return text[:start + len(RESULTS_BEGIN)] + "\n" + results_markdown(folder) + "\n" + text[end:]


def results_main(argv: list[str]) -> int:
    """``sinkflex bench results [--readme README.md]``: print the paper-vs-ours table, or rewrite the
    README's block with it."""
    parser = argparse.ArgumentParser(prog="sinkflex bench results",
                                     description="The paper's claims beside our measurements in data/, as Markdown.")
    parser.add_argument("--data", type=Path, default=None, help="the data folder (default: the project's data/)")
    parser.add_argument("--readme", type=Path, default=None,
                        help="rewrite this file's results block instead of printing the table")
    args = parser.parse_args(argv)
    if args.readme is None:
        print(results_markdown(args.data))
        return 0
    try:
        text = args.readme.read_text()
        new = readme_with_results(text, args.data)
    except (OSError, ValueError) as err:
        print(f"sinkflex bench results: {args.readme}: {err}", file=sys.stderr)
        return 2
    if new != text:
        args.readme.write_text(new)
    print(f"{args.readme}: results block {'rewritten' if new != text else 'already up to date'}")
    return 0


def step_rows(results):
    """Only the rows that measure a whole training step (not the attention-alone or weights-alone
    rows that ``vram_recorded_*.csv`` also carries)."""
    if "measurement" not in results:
        return results
    keep = results["measurement"].isna() | results["measurement"].isin(["lora_step", "grpo_step"])
    return results[keep & results["tokens"].notna()]


def targets_report(results):
    """Issue 8's targets against what ``results`` (GPU rows, capped at 80 GiB) hold: one row per
    target with the measured value or "not measured yet"."""
    import pandas as pd

    gpu = step_rows(results)
    gpu = gpu[gpu["memory_metric"].astype(str).str.startswith("cuda")] if len(gpu) else gpu
    fresh = gpu[~gpu["recorded"]] if len(gpu) else gpu

    def pick(df, attention, logprobs, mlp, tokens):
        sel = df[(df["attention"] == attention) & (df["logprobs"] == logprobs) & (df["mlp"] == mlp)
                 & (df["tokens"] == tokens) & (df["status"] == "ok")]
        return sel.iloc[0] if len(sel) else None

    rows = []
    r = pick(fresh, "sinkflex", "chunked", "plain", 8192) if len(fresh) else None
    rows.append({"target": "sinkflex + memory-light log-probs at 8,192 tokens <= 18.5 GiB",
                 "measured": f"{r['peak_gib']:.2f} GiB" if r is not None else "not measured yet",
                 "met": ("yes" if r["peak_gib"] <= 18.5 else "no") if r is not None else ""})
    longest = ""
    met = ""
    if len(fresh):
        fits = fresh[(fresh["status"] == "ok") & (fresh["peak_gib"] <= 80)]
        capped = fits[fits["cap_gib"].astype(str).isin(["80", "80.0"])] if "cap_gib" in fits else fits
        if len(capped):
            best = capped.sort_values(["tokens", "peak_gib"], ascending=[False, True]).iloc[0]
            longest = f"{int(best['tokens'])} tokens ({best['case']}, {best['peak_gib']:.2f} GiB)"
            met = "yes" if best["tokens"] >= 131072 else "no"
    rows.append({"target": "longest trajectory under the 80 GiB cap: 131,072 tokens",
                 "measured": longest or "not measured yet", "met": met})
    for tokens, need, what in ((8192, 1.0, "no slower than stock sdpa"), (65536, 2.0, "at least 2x faster than sdpa"),
                               (131072, 2.0, "at least 2x faster than sdpa")):
        mlp = "plain" if tokens <= 8192 else "tiled"
        a = pick(fresh, "sdpa", "chunked", mlp, tokens) if len(fresh) else None
        b = pick(fresh, "sinkflex", "chunked", mlp, tokens) if len(fresh) else None
        if a is not None and b is not None:
            speedup = a["step_s"] / b["step_s"]
            rows.append({"target": f"step time at {tokens:,} tokens: {what}",
                         "measured": f"sdpa {a['step_s']:.2f} s, sinkflex {b['step_s']:.2f} s ({speedup:.2f}x)",
                         "met": "yes" if speedup >= need * 0.999 else "no"})
        else:
            rows.append({"target": f"step time at {tokens:,} tokens: {what}", "measured": "not measured yet",
                         "met": ""})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------
# Figures made from data/ (notebook 07 regenerates them all)
# ----------------------------------------------------------------------------------------------

def plot_cpu_step_memory(results, ax=None):
    """CPU rows: memory the step adds on top of the built process (peak RSS - RSS before the step)
    against trajectory length, one line per case."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    cpu = results[(results["memory_metric"] == "cpu_peak_rss") & (results["status"] == "ok")].copy()
    cpu["step_gib"] = pd_numeric(cpu["peak_gib"]) - pd_numeric(cpu["base_gib"])
    colors = {"eager": "tab:red", "sdpa": "tab:blue", "flex": "tab:green", "sinkflex": "tab:purple"}
    for (attention, logprobs, mlp), grp in cpu.groupby(["attention", "logprobs", "mlp"], sort=True):
        grp = grp.sort_values("tokens")
        # colour: attention; line: log-probs; marker: MLP
        ax.plot(grp["tokens"], grp["step_gib"] * 1024, color=colors.get(attention, "gray"),
                ls="-" if logprobs == "full" else "--", marker="o" if mlp == "plain" else "s", ms=5,
                mfc="none" if mlp == "tiled" else None,
                label=f"{attention} · {logprobs} logprobs · {mlp} mlp")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("trajectory length (tokens)")
    ax.set_ylabel("memory added by the step (MiB, peak RSS)")
    preset = cpu["preset"].iloc[0] if len(cpu) else "tiny"
    ax.set_title(f"One GRPO step on CPU, preset {preset}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def pd_numeric(series):
    import pandas as pd

    return pd.to_numeric(series, errors="coerce")


def regenerate_figures(data: Path | None = None, figures: Path | None = None):
    """Remake every figure that is drawn from ``data/`` CSVs; returns a table of
    (figure, made_from, status). Missing inputs are reported, not raised."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import pandas as pd

    from .paths import data_dir, figures_dir

    data = Path(data) if data else data_dir()
    figures = Path(figures) if figures else figures_dir()
    figures.mkdir(parents=True, exist_ok=True)
    done = []

    results = load_vram_results(data)
    paper = load_paper_claims(data)
    gpu = step_rows(results) if len(results) else results
    gpu = gpu[gpu["memory_metric"].astype(str).str.startswith("cuda") | (gpu["status"] != "ok")] if len(gpu) else gpu
    gpu = gpu[gpu["device"].astype(str) == "cuda"] if len(gpu) else gpu
    if len(gpu):
        fig, ax = plt.subplots(figsize=(11, 5.5))
        plot_peak_vs_length(gpu, paper=paper, cap_gib=80.0, ax=ax,
                            title="Peak GPU memory of one GRPO step, Qwen2.5-7B shape, LoRA r=16")
        fig.tight_layout()
        fig.savefig(figures / "vram_vs_length.png", dpi=120)
        plt.close(fig)
        done.append(("vram_vs_length.png", ", ".join(sorted(set(gpu["file"]))), "regenerated"))
    else:
        done.append(("vram_vs_length.png", "data/vram_*.csv (GPU rows)", "skipped: no GPU rows in data/"))

    cpu_path = data / "vram_cpu.csv"
    if cpu_path.exists() and len(results) and (results["memory_metric"] == "cpu_peak_rss").any():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        plot_cpu_step_memory(results[results["file"] == "vram_cpu.csv"], ax=ax)
        fig.tight_layout()
        fig.savefig(figures / "vram_cpu.png", dpi=120)
        plt.close(fig)
        done.append(("vram_cpu.png", "vram_cpu.csv", "regenerated"))
    else:
        done.append(("vram_cpu.png", "vram_cpu.csv", "skipped: not in data/ yet (notebook 06, default mode)"))

    att = [p for p in sorted(data.glob("attention_*.csv"))]
    att_frames = []
    for path in att:
        df = pd.read_csv(path)
        if {"case", "tokens", "ms"} <= set(df.columns):
            if "device" in df:  # timings of the GPU machine, not CPU exactness checks
                df = df[df["device"].astype(str) == "cuda"]
            if len(df):
                att_frames.append(df.assign(file=path.name))
    if att_frames:
        df = pd.concat(att_frames, ignore_index=True)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (case, fname), grp in df.groupby(["case", "file"], sort=True):
            grp = grp.sort_values("tokens")
            ax.plot(grp["tokens"], grp["ms"], marker="o", label=f"{case} ({fname})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("tokens")
        ax.set_ylabel("attention forward + backward (ms)")
        ax.set_title("Attention alone, bf16, 28 heads, head dim 128")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(figures / "attention_time.png", dpi=120)
        plt.close(fig)
        done.append(("attention_time.png", ", ".join(sorted(set(df["file"]))), "regenerated"))
    else:
        done.append(("attention_time.png", "data/attention_*.csv", "skipped: not in data/ yet"))

    curve = data / "reward_curve.csv"
    if curve.exists():
        train = importlib.import_module("sinkflex_core.train")
        extra = {name: data / f"reward_curve_{name}.csv" for name in ("sft", "all_tasks")}
        extra = {name: pd.read_csv(path) for name, path in extra.items() if path.exists()}
        # The same figure as notebook 05's (which may add a run of one's own).
        fig = train.reward_figure(pd.read_csv(curve), extra.get("sft"), baseline=extra.get("all_tasks"))
        fig.savefig(figures / "reward_curve.png", dpi=120)
        plt.close(fig)
        done.append(("reward_curve.png", ", ".join(["reward_curve.csv"] + [f"reward_curve_{n}.csv" for n in extra]),
                     "regenerated"))
    else:
        done.append(("reward_curve.png", "reward_curve.csv", "skipped: not in data/ yet (benchmarks/reproduce_curve.py)"))

    baselines = data / "01_env_baselines.csv"
    if baselines.exists():
        table = pd.read_csv(baselines)
        envs = list(dict.fromkeys(table["env"]))
        ks = [c for c in table.columns if c.startswith("pass^")]
        fig, axes = plt.subplots(1, len(envs), figsize=(4.5 * len(envs), 3.2), sharey=True, squeeze=False)
        styles = {"oracle": ("o", "-", 8), "random": ("x", "--", 10), "do-nothing": ("s", ":", 5)}
        for ax, env_id in zip(axes[0], envs):
            for _, r in table[table["env"] == env_id].iterrows():
                marker, line, size = styles.get(r["agent"], ("^", "-", 6))
                ax.plot(range(1, len(ks) + 1), [r[c] for c in ks], marker=marker, linestyle=line, markersize=size,
                        label=f"{r['agent']} (mean reward {r['mean_reward']:.2f})")
            ax.set_title(f"{env_id} (test split)")
            ax.set_xlabel("k")
            ax.set_xticks(range(1, len(ks) + 1))
            ax.legend(loc="center right", fontsize=8)
        axes[0][0].set_ylabel("pass^k")
        axes[0][0].set_ylim(-0.05, 1.05)
        fig.tight_layout()
        fig.savefig(figures / "01_env_baselines.png", dpi=120)
        plt.close(fig)
        done.append(("01_env_baselines.png", "01_env_baselines.csv", "regenerated"))
    else:
        done.append(("01_env_baselines.png", "01_env_baselines.csv", "skipped: not in data/ yet (notebook 01)"))
    return pd.DataFrame(done, columns=["figure", "made_from", "status"])


if __name__ == "__main__":
    sys.exit(main())
