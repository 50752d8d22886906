"""One GRPO update on one batch of rollouts, the function both the trainer and the memory harness
(``sinkflex bench vram``) call, so that what the harness measures is what training runs.

The batch is a dict of (B, L) tensors (``data.concat_rollouts``): ``input_ids``, ``attention_mask``,
``loss_mask`` (1 where the token is the policy's), ``old_logprobs`` (the sampling log-probs, aligned
with the tokens) and ``position_ids``. The update is ``ppo_epochs x num_minibatches`` optimizer steps;
mini-batch k takes the trajectories k, k+M, ... of every group, and each is cut into micro-batches
of ``micro_batch_size`` trajectories whose gradients accumulate. Losses are normalised by the
mini-batch's global token (and sequence) counts, so 1 and N processes compute the same update.
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import grpo
from .config import TrainConfig
from .data import position_in_group, trim_rows
from .distributed import Dist, full_tensor
from .policy import TokenLogprobs, trainable_parameters

# What grpo_update adds up over its micro-batches; per-token sums are weighted by token counts.
UPDATE_SUMS = ("loss", "pg_loss", "kl", "entropy_tok", "clip_tok", "ratio_tok", "tokens", "grad_norm",
               "gap_abs", "gap_out", "gap_tokens")


@torch.no_grad()
def sampler_gap_sums(logp: torch.Tensor, sampler_logp: torch.Tensor, loss_mask: torch.Tensor, clip_low: float,
                     clip_high: float) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's, on the same weights: sums over the policy
    tokens of ``|logp - sampler_logp|`` (``gap_abs``), of the tokens whose ratio ``exp(logp -
    sampler_logp)`` lies outside ``[1 - clip_low, 1 + clip_high]`` (``gap_out``), and their count
    (``gap_tokens``). All inputs (B, L); ``loss_mask`` 1 on policy tokens."""
    m = loss_mask.to(torch.bool)
    diff = (logp.float() - sampler_logp.float())[m]
    ratio = diff.exp()
    out = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return {"gap_abs": float(diff.abs().sum()), "gap_out": float(out.sum()), "gap_tokens": float(m.sum())}


def loss_config(cfg: TrainConfig) -> grpo.GRPOLossConfig:
    """The loss settings of a run."""
    return grpo.GRPOLossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or None,
                               kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, entropy_coef=cfg.entropy_coef,
                               agg_mode=cfg.loss_agg, tis_cap=cfg.tis_cap)


def lr_lambda(cfg: TrainConfig, total_updates: int):
    """The learning-rate factor of optimizer step ``i``: linear warm-up, then constant or cosine."""
    def factor(i: int) -> float:
        if cfg.warmup_steps and i < cfg.warmup_steps:
            return (i + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            done = (i - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        return 1.0

    return factor


def policy_logprobs(module: TokenLogprobs, rows: dict[str, torch.Tensor], device: torch.device):
    """``module``'s (log-probs, entropies), each (B, L), of the rows."""
    return module(rows["input_ids"].to(device), rows["attention_mask"].to(device), rows["position_ids"].to(device))


def micro_batches(rows: dict, idx: torch.Tensor, size: int, dist: Dist,
                  same_count_on_ranks: bool) -> list[tuple[torch.Tensor, bool]]:
    """The rows ``idx``, longest first, in micro-batches of ``size`` (similar lengths waste less
    compute on padding), each with a flag ``real``. With ``same_count_on_ranks`` every rank gets as many
    micro-batches as the rank with the most, because FSDP's collectives run at every forward and
    backward on every rank: the extra ones are row 0, to be weighted 0 and not counted (needed when
    ranks can keep different numbers of rows: ``drop_uniform_groups``)."""
    idx = idx[torch.argsort(rows["attention_mask"][idx].sum(1), descending=True, stable=True)]
    parts = [(idx[j:j + size], True) for j in range(0, len(idx), size)]
    n = int(dist.reduce({"n": float(len(parts))}, "max")["n"]) if same_count_on_ranks else len(parts)
    return parts + [(torch.zeros(1, dtype=torch.long), False)] * (n - len(parts))


def _first_column(rows: dict, idx: torch.Tensor) -> int:
    """The first column of ``rows[idx]`` that is not padding in all of them (where trim_rows starts)."""
    return int(rows["attention_mask"][idx].bool().any(0).nonzero().min())


@torch.no_grad()
def frozen_logprobs(module: TokenLogprobs, rows: dict, cfg: TrainConfig, dist: Dist,
                    only: torch.Tensor | None = None, disable_adapter: bool = False) -> torch.Tensor:
    """(B, L) log-probs of ``module`` without gradients, computed in micro-batches, for the rows
    ``only`` (default: all; the others stay 0). ``disable_adapter``: those of the base model under a
    LoRA policy (the reference of a LoRA run)."""
    B = rows["input_ids"].shape[0]
    out = torch.zeros_like(rows["old_logprobs"], dtype=torch.float32)
    parts = micro_batches(rows, torch.arange(B) if only is None else only, cfg.micro_batch_size, dist,
                          cfg.drop_uniform_groups)
    for idx, real in parts:
        sub = trim_rows(rows, idx)
        lo = _first_column(rows, idx)
        if disable_adapter:
            with module.lm.disable_adapter():
                logp, _ = policy_logprobs(module, sub, dist.device)
        else:
            logp, _ = policy_logprobs(module, sub, dist.device)
        if real:
            out[idx, lo:lo + logp.shape[1]] = logp.float().cpu()
    return out


def grpo_update(policy: TokenLogprobs, optimizer: torch.optim.Optimizer, scheduler, rows: dict,
                advantages: torch.Tensor, train_rows: torch.Tensor, ref_logprobs: torch.Tensor | None,
                cfg: TrainConfig, dist: Dist) -> dict[str, float]:
    """The optimizer steps of one GRPO step on ``rows``, for the rows where ``train_rows`` (B,) is True.

    ``advantages`` (B,), ``ref_logprobs`` (B, L) or None (no KL term). Returns this rank's sums over
    micro-batches (:data:`UPDATE_SUMS`), ``ratio_max`` and ``updates``, the number of optimizer steps.

    The micro-batches before the first optimizer step run on the weights that sampled the rollouts:
    there the trainer's log-probs are compared with the sampler's (``rows["sampler_logprobs"]`` if
    set, else ``old_logprobs``), in ``gap_*`` (:func:`sampler_gap_sums`)."""
    c, d = cfg, dist
    loss_cfg = loss_config(c)
    slot = position_in_group(rows["group_ids"])
    acc = dict.fromkeys(UPDATE_SUMS, 0.0) | {"ratio_max": 0.0, "updates": 0}
    # tis_cap: the sampler's log-probs, kept apart when old_logprobs were recomputed (train.async_rollouts)
    behaviour = rows.get("sampler_logprobs") if c.tis_cap > 0 else None
    acc |= {"tis_clip_tok": 0.0, "tis_weight_tok": 0.0}
    policy.train()
    for _epoch in range(c.ppo_epochs):
        for k in range(c.num_minibatches):
            mb_idx = ((slot % c.num_minibatches == k) & train_rows).nonzero().flatten()
            # The sum over micro-batches (global normalisers) does not depend on how they are cut.
            norms = grpo.loss_normalizers(rows["loss_mask"][mb_idx])
            counts = d.reduce({"tokens": norms["num_tokens"], "seqs": norms["num_seqs"]})
            n_tok, n_seq = max(1, int(counts["tokens"])), max(1, int(counts["seqs"]))
            micro = micro_batches(rows, mb_idx, c.micro_batch_size, d, c.drop_uniform_groups)
            if not micro:
                # No rank has a row to learn from in this mini-batch: no optimizer step, but the
                # learning-rate schedule moves on (it counts mini-batch slots, so that a cosine
                # schedule still ends at the last step).
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                    scheduler.step()
                continue
            mb = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0}
            for idx, real in micro:
                sub = trim_rows(rows, idx)
                lo, width = _first_column(rows, idx), sub["input_ids"].shape[1]
                logp, ent = policy_logprobs(policy, sub, d.device)
                dev = logp.device
                ref_sub = ref_logprobs[idx, lo:lo + width].to(dev) if ref_logprobs is not None else None
                beh_sub = behaviour[idx, lo:lo + width].to(dev).float() if behaviour is not None else None
                if real and acc["updates"] == 0:  # the weights are still those that sampled
                    sampler = rows.get("sampler_logprobs")
                    sampler = sub["old_logprobs"] if sampler is None else sampler[idx, lo:lo + width]
                    for key, value in sampler_gap_sums(logp, sampler.to(dev), sub["loss_mask"].to(dev), c.clip_low,
                                                       c.clip_high).items():
                        acc[key] += value
                loss, m = grpo.grpo_loss(logp, sub["old_logprobs"].to(dev).float(), advantages[idx].to(dev),
                                         sub["loss_mask"].to(dev), ref_logp=ref_sub, entropy=ent, config=loss_cfg,
                                         num_tokens=n_tok, num_seqs=n_seq, norm_length=c.max_total_tokens,
                                         behaviour_logp=beh_sub)
                # FSDP averages gradients over ranks; the loss is already a global mean.
                (loss * (d.world if real else 0.0)).backward()
                if not real:
                    continue
                t = m["num_tokens"]
                mb["loss"] += m["loss"]
                mb["pg_loss"] += m["pg_loss"]
                mb["kl"] += m.get("kl_ref", 0.0)
                acc["entropy_tok"] += m.get("entropy", 0.0) * t
                acc["clip_tok"] += m["clip_frac"] * t
                acc["ratio_tok"] += m["ratio_mean"] * t
                acc["tokens"] += t
                acc["ratio_max"] = max(acc["ratio_max"], m["ratio_max"])
                if beh_sub is not None:
                    acc["tis_clip_tok"] += m["tis_clip_frac"] * t
                    acc["tis_weight_tok"] += m["tis_weight_mean"] * t
            grad_norm = float("nan")
            if c.grad_clip > 0:
                grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(trainable_parameters(policy),
                                                                             c.grad_clip)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            for key, value in mb.items():
                acc[key] += value
            acc["grad_norm"] += grad_norm
            acc["updates"] += 1
    policy.eval()
    return acc
