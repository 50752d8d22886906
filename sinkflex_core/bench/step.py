"""One case of the VRAM harness, in this process: the case (attention x log-prob path x MLP x length,
at a model shape of :mod:`sinkflex_core.presets`), and one GRPO step of the trainer's own update
(:func:`sinkflex_core.train.update.grpo_update`, on a policy from :func:`sinkflex_core.train.load_model`)
with its peak memory and time.

The step: reference log-probs under ``no_grad`` (LoRA adapters disabled: the base model; with full
fine-tuning the same weights stand in for the trainer's frozen copy, which changes no activation
memory), which are also the sampling log-probs (the first update of a batch); then the trainer's
update on one trajectory: forward + backward with ``grpo.grpo_loss`` (clipped ratio, KL to the
reference, token-mean), gradient clipping and an AdamW step; gradient checkpointing, batch 1.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from dataclasses import dataclass, field

from ..presets import shape

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

    preset: str = "tiny"  # a name of sinkflex_core.presets: a shape, or a run (its model's shape)
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
        preset = shape(self.preset)
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



def train_config(case: Case, settings: Settings):
    """The :class:`sinkflex_core.train.TrainConfig` of a case: the trainer's defaults, with the
    case's attention, log-prob path, MLP tiling and fine-tuning, gradient checkpointing on, and one
    trajectory per optimizer step."""
    from ..train import TrainConfig

    settings = settings.resolved()
    if settings.finetune not in ("lora", "full"):
        raise ValueError(f"finetune must be 'lora' or 'full', got {settings.finetune!r}")
    return TrainConfig(
        seed=settings.seed, dtype={"bf16": "bfloat16", "fp32": "float32"}[settings.dtype],
        attention=case.attention, n_sink=settings.n_sink, window=settings.window, learn_sinks=True,
        gradient_checkpointing=True, lora=settings.finetune == "lora", lora_r=settings.lora_r,
        logprob_chunk_size=settings.chunk_size if case.logprobs == "chunked" else 0,
        tile_mlp_tokens=settings.slice_tokens if case.mlp == "tiled" else 0, max_total_tokens=case.tokens,
        kl_coef=settings.kl_coef, lr=1e-5, ppo_epochs=1, num_minibatches=1, micro_batch_size=1)


def build_policy(case: Case, settings: Settings):
    """The policy of one case, ready to train: ``(policy, cfg)``, ``policy`` a
    :class:`sinkflex_core.train.TokenLogprobs` around the model that
    :func:`sinkflex_core.train.load_model` builds for ``cfg`` (:func:`train_config`) at the preset's
    shape, with random weights."""
    import torch

    from ..train import TokenLogprobs, load_model

    settings = settings.resolved()
    if case.logprobs not in LOGPROBS:
        raise ValueError(f"logprobs must be one of {LOGPROBS}, got {case.logprobs!r}")
    cfg = train_config(case, settings)
    model = load_model(cfg, None, torch.device(settings.device),
                       model_config=shape(settings.preset).model_config(max_tokens=case.tokens))
    policy = TokenLogprobs(model, cfg.logprob_chunk_size, entropy_grad=cfg.entropy_coef > 0)
    policy.train()
    return policy, cfg


def step_batch(tokens: int, vocab: int, device: str, seed: int) -> dict:
    """One trajectory of random token ids as the trainer's batch (see ``train.concat_rollouts``):
    ``input_ids``, ``attention_mask``, ``loss_mask`` (the first eighth, the prompt, masked out),
    ``position_ids``, all (1, L), ``group_ids`` (1,); ``advantages`` (1,) +1, as if the trajectory
    beat its group. ``old_logprobs`` are filled in by :func:`grpo_step`."""
    import torch

    if tokens < 2:
        raise ValueError(f"a trajectory needs at least 2 tokens, got {tokens}")
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    loss_mask = torch.ones(1, tokens)
    loss_mask[:, : 1 + max(1, tokens // 8)] = 0.0  # column t scores token t: the first scored is t = 1
    return {"input_ids": input_ids, "attention_mask": torch.ones(1, tokens, dtype=torch.long), "loss_mask": loss_mask,
            "position_ids": torch.arange(tokens)[None], "group_ids": torch.zeros(1, dtype=torch.long),
            "old_logprobs": torch.zeros(1, tokens), "advantages": torch.ones(1)}


def grpo_step(policy, optimizer, scheduler, batch: dict, cfg, device: str = "cpu") -> float:
    """One GRPO update of the trainer on ``batch`` (:func:`step_batch`); returns the loss (a float).
    The reference log-probs, computed first, are the sampling log-probs too (the first update)."""
    import torch

    from ..train import Dist
    from ..train.update import frozen_logprobs, grpo_update

    dist = Dist(device=torch.device(device))
    rows = dict(batch)
    lora = hasattr(policy.lm, "disable_adapter")
    ref = frozen_logprobs(policy, rows, cfg, dist, disable_adapter=lora)
    rows["old_logprobs"] = ref
    train_rows = torch.ones(len(rows["advantages"]), dtype=torch.bool)
    sums = grpo_update(policy, optimizer, scheduler, rows, rows["advantages"], train_rows, ref, cfg, dist)
    return float(sums["loss"])


def run_case(case: Case, settings: Settings, cap_this_process: bool = False) -> dict:
    """Run one case in this process and return its measurements (a dict of CSV columns).

    Out-of-memory gives ``status="oom"`` (with the peak reached before it); a case that cannot run
    here gives ``status="unavailable"`` and the reason in ``note``. ``settings.cap_gib`` applies on
    CPU only with ``cap_this_process`` (it limits the whole process for the rest of its life, which
    suits the per-case child, not a caller that goes on)."""
    import torch

    from ..train.policy import trainable_parameters
    from ..train.update import lr_lambda

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
            # the cap in force: a card smaller than the cap (an 80 GB H100 under 80 GiB) is the whole card
            row["cap_gib"] = round(min(settings.cap_gib, total / GIB), 2)
    memory = _Memory(settings.device)
    oom_types = (torch.OutOfMemoryError, MemoryError)
    try:
        policy, cfg = build_policy(case, settings)
        optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, settings.warmup + settings.steps))
        batch = step_batch(case.tokens, shape(settings.preset).vocab, settings.device, settings.seed)
        row["base_gib"] = memory.current_gib()
        if settings.device == "cpu" and settings.cap_gib and cap_this_process:
            _cap_cpu_address_space(settings.cap_gib)
        times = []
        for i in range(settings.warmup + settings.steps):
            if i == settings.warmup:
                memory.reset()  # warm-up steps (compilation, allocator growth) are not measured
            _sync(settings.device)
            t0 = time.perf_counter()
            row["loss"] = grpo_step(policy, optimizer, scheduler, batch, cfg, settings.device)
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


