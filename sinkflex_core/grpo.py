"""GRPO, one function per formula: group advantages, the clipped policy loss, KL to the reference
policy, loss aggregation, per-step metrics, and memory-light per-token log-probs.

Shapes: ``B`` trajectories (rows), ``L`` tokens per row, ``H`` hidden size, ``V`` vocabulary size.
Per-token tensors are ``(B, L)`` and aligned with ``input_ids``: ``logp[:, t]`` is the log-prob of
token ``input_ids[:, t]`` (see :func:`causal_token_logprobs`), and ``loss_mask[:, t]`` is 1 where the
policy wrote that token and 0 for prompt, environment (tool / customer) and padding tokens.

Sources of the formulas:

- GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), group-relative advantages, KL to the
  reference model as a loss term with the k3 estimator, coefficient 0.04.
- PPO clipped surrogate: Schulman et al. 2017 (arXiv:1707.06347).
- Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (arXiv:1912.09729).
- Clip-higher (separate low / high clip) and token-level loss: Yu et al. 2025, "DAPO" (arXiv:2503.14476).
- No std normalisation, constant length normaliser: Liu et al. 2025, "Understanding R1-Zero-Like
  Training" (Dr. GRPO, arXiv:2503.20783).
- KL estimators k1, k2, k3: J. Schulman, "Approximating KL Divergence" (2020, blog note).
- Behaviour-policy weight with truncated importance sampling (TIS): F. Yao, L. Liu et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training" (blog note; verl's
  ``tis_imp_ratio_cap``, cap 2 in their runs); the proximal / behaviour split of the ratio is the
  decoupled PPO objective of Fu et al. 2025, "AReaL" (arXiv:2505.24298).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "GRPOLossConfig",
    "PolicyLossOutput",
    "aggregate_loss",
    "behaviour_weights",
    "causal_token_logprobs",
    "group_advantages",
    "grpo_loss",
    "kl_penalty",
    "loss_normalizers",
    "masked_mean",
    "naive_token_logprobs",
    "policy_loss",
    "reward_metrics",
    "rows_with_signal",
    "token_advantages",
    "token_logprobs",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shapes must match, got {shapes}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is nonzero; 0 if the mask is empty.

    x, mask: same shape. Returns a scalar."""
    _check_same_shape(x=x, mask=mask)
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)


# --------------------------------------------------------------------------------------------------
# Advantages


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6,
                     norm_by_std: bool = True) -> torch.Tensor:
    """Group-relative advantage of each trajectory (GRPO outcome supervision, DeepSeekMath §4.1.2).

    ``A_i = (r_i - mean_g) / (std_g + eps)`` where ``mean_g`` and ``std_g`` are over the trajectories
    sharing ``i``'s group id (the G rollouts of one task). ``std_g`` is the *unbiased* std (divides by
    N - 1), as verl, TRL and OpenRLHF use. With ``norm_by_std=False`` the advantage is only centred,
    ``A_i = r_i - mean_g`` (Dr. GRPO: dividing by the std over-weights tasks that are almost always
    solved or almost always failed).

    A group of one trajectory, or a group whose rewards are all equal, carries no signal: its
    advantages are exactly 0 (never NaN, whatever ``eps``).

    Args:
        rewards: (B,) float, one scalar reward per trajectory.
        group_ids: (B,) int, trajectories with the same id form a group (ids need not be contiguous).
        eps: added to the std; >= 0.
        norm_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
    Returns:
        (B,) advantages, dtype of ``rewards`` (float32 if rewards are integers).
    """
    rewards = torch.as_tensor(rewards)
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if rewards.dim() != 1 or group_ids.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be (B,), got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise ValueError("group_ids must be integers")
    if not eps >= 0:  # also refuses NaN, which would make every advantage NaN
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    if rewards.numel() == 0:
        return rewards.clone()
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inv, torch.ones_like(rewards))
    mean = torch.zeros_like(count).index_add_(0, inv, rewards) / count
    centred = rewards - mean[inv]
    # "all equal" is decided on the rewards themselves: the float mean of equal values need not be
    # bitwise equal to them, which would leave tiny nonzero advantages to be blown up by 1/eps.
    rmax = torch.full_like(count, -torch.inf).scatter_reduce(0, inv, rewards, "amax")
    rmin = torch.full_like(count, torch.inf).scatter_reduce(0, inv, rewards, "amin")
    no_signal = (rmax == rmin)[inv]
    if norm_by_std:
        var = torch.zeros_like(count).index_add_(0, inv, centred * centred) / (count - 1).clamp_min(1)
        adv = centred / (var.sqrt()[inv] + eps)
    else:
        adv = centred
    return torch.where(no_signal, torch.zeros_like(adv), adv)


def token_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per trajectory to its policy tokens: ``A[b, t] = A[b] * mask[b, t]``.

    advantages: (B,); loss_mask: (B, L). Returns (B, L), dtype of ``advantages``; 0 off the mask."""
    if advantages.dim() != 1 or loss_mask.dim() != 2 or advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"need advantages (B,) and loss_mask (B, L), got {tuple(advantages.shape)} "
                         f"and {tuple(loss_mask.shape)}")
    return advantages[:, None] * loss_mask.to(advantages.dtype)


# --------------------------------------------------------------------------------------------------
# Policy loss and KL


@dataclass
class PolicyLossOutput:
    """Per-token terms of the clipped policy loss, all (B, L).

    loss: the per-token loss to aggregate (0 off the mask is *not* applied here: aggregate with the mask).
    ratio: pi / pi_old. clipped_low / clipped_high: the clipped branch is the active one because the
    ratio left [1 - clip_low, 1 + clip_high]. dual_clipped: the dual-clip bound is active."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                max_log_ratio: float = 20.0) -> PolicyLossOutput:
    """PPO clipped surrogate, per token, as a loss to minimise (PPO; GRPO eq. 3; DAPO eq. 10).

    ``ratio = exp(clamp(logp - old_logp, -max_log_ratio, max_log_ratio))`` (the clamp keeps a stale or
    corrupted old log-prob from overflowing ``exp``; within the clamp it changes nothing).
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``. Separate low and high
    clips are DAPO's "clip-higher" (e.g. 0.2 / 0.28); the GRPO and PPO papers use 0.2 / 0.2.
    With ``dual_clip = c > 1`` tokens with ``A < 0`` get ``loss = min(loss, -A * c)``: a very large
    ratio on a bad action can then not produce an unbounded loss (dual-clip PPO, Ye et al. 2020).

    Args:
        logp: (B, L) log-probs of the sampled tokens under the current policy (with grad).
        old_logp: (B, L) the same under the policy that sampled them (no grad needed).
        advantages: (B, L) per token (see :func:`token_advantages`) or (B,) per trajectory.
    Returns:
        :class:`PolicyLossOutput` with (B, L) tensors; aggregate ``.loss`` with :func:`aggregate_loss`.
    """
    _check_same_shape(logp=logp, old_logp=old_logp)
    if advantages.dim() == 1 and logp.dim() == 2 and advantages.shape[0] == logp.shape[0]:
        advantages = advantages[:, None].expand_as(logp)
    _check_same_shape(logp=logp, advantages=advantages)
    # written so that NaN fails too: a NaN clip makes the loss NaN, a NaN dual clip is silently off
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0), got {dual_clip}")
    log_ratio = (logp - old_logp).clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    # The clipped branch wins exactly when it is strictly larger: that is PPO's "clip fraction".
    active = clipped > unclipped
    with torch.no_grad():
        clipped_low = active & (ratio < 1 - clip_low)
        clipped_high = active & (ratio > 1 + clip_high)
    dual_clipped = torch.zeros_like(active)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_clipped = (adv < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return PolicyLossOutput(loss=loss, ratio=ratio, clipped_low=clipped_low, clipped_high=clipped_high,
                            dual_clipped=dual_clipped)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", max_log_ratio: float = 20.0,
               max_value: float | None = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020).

    With ``x = ref_logp - logp`` (clamped to ``+-max_log_ratio``):
    ``k1 = -x`` (unbiased, high variance, can be negative), ``k2 = x**2 / 2`` (biased, low variance),
    ``k3 = exp(x) - x - 1`` (unbiased, low variance, always >= 0; GRPO eq. 4 uses it with coefficient
    0.04). ``k3`` is further clamped to ``max_value`` (as verl does) so one token whose reference
    probability exploded cannot dominate the step; ``None`` disables that.

    logp, ref_logp: (B, L). Returns (B, L); multiply by the KL coefficient and aggregate."""
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    x = (ref_logp - logp).clamp(-max_log_ratio, max_log_ratio)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        k3 = torch.exp(x) - x - 1
        return k3 if max_value is None else k3.clamp(max=max_value)
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")


def behaviour_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float = 0.0,
                      max_log_ratio: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weight of the proximal ("old") policy against the behaviour policy that
    actually sampled the tokens, optionally truncated (TIS; Yao et al. 2025; AReaL's decoupled PPO).

    When the sampler is not the learner's old policy (an older version of the weights in an
    asynchronous run, or another engine such as vLLM), the PPO ratio ``pi / pi_old`` with ``pi_old``
    recomputed by the learner is only half of the importance ratio ``pi / mu`` against the behaviour
    policy ``mu``. The other half multiplies each token's loss:

    ``w = exp(clamp(old_logp - behaviour_logp, -max_log_ratio, max_log_ratio))``, and with
    ``cap = C > 0``: ``w = min(w, C)`` (truncated importance sampling: bounded variance, a bias only on
    the tokens the learner likes much more than the sampler did). ``cap = 0`` (or ``inf``) leaves it
    untruncated. ``w`` carries no gradient (both inputs are fixed for the update).

    Args:
        old_logp: (B, L) log-probs of the sampled tokens under the proximal policy (the learner's
            weights before this update).
        behaviour_logp: (B, L) the log-probs recorded when sampling.
        cap: C, the truncation constant; >= 0.
    Returns:
        ``(weights, truncated)``: (B, L) float weights and (B, L) bool, True where ``min`` took ``C``.
    """
    _check_same_shape(old_logp=old_logp, behaviour_logp=behaviour_logp)
    if not cap >= 0:  # also refuses NaN
        raise ValueError(f"cap must be >= 0 (0: no truncation), got {cap}")
    with torch.no_grad():
        w = torch.exp((old_logp - behaviour_logp).clamp(-max_log_ratio, max_log_ratio))
        truncated = w > cap if cap > 0 else torch.zeros_like(w, dtype=torch.bool)
        return torch.where(truncated, torch.full_like(w, cap), w), truncated


# --------------------------------------------------------------------------------------------------
# Aggregation


def loss_normalizers(loss_mask: torch.Tensor) -> dict[str, int]:
    """The global counts to pass to :func:`aggregate_loss` when a mini-batch is split into micro-batches.

    loss_mask: (B, L) of the *whole* mini-batch. Returns ``{"num_tokens": policy tokens,
    "num_seqs": rows with at least one policy token}``."""
    m = loss_mask != 0
    return {"num_tokens": int(m.sum()), "num_seqs": int(m.any(dim=-1).sum())}


def aggregate_loss(loss: torch.Tensor, loss_mask: torch.Tensor, mode: str = "token-mean",
                   num_tokens: int | None = None, num_seqs: int | None = None,
                   norm_length: int | None = None) -> torch.Tensor:
    """Reduce a (B, L) per-token loss to a scalar over the masked tokens.

    - ``"token-mean"``: ``sum(loss * mask) / num_tokens``; every policy token weighs the same, so long
      trajectories weigh more (DAPO's token-level loss; verl's and TRL's default).
    - ``"seq-mean-token-mean"``: the mean over trajectories of each trajectory's token mean
      (``sum_b [sum_t loss*mask / n_b] / num_seqs``); every trajectory weighs the same and a token of a
      short one weighs more (the GRPO paper's eq. 3).
    - ``"seq-mean-token-sum-norm"``: ``sum(loss * mask) / (num_seqs * norm_length)`` with a constant
      ``norm_length`` (e.g. the maximum response length): Dr. GRPO's unbiased form, every token weighs
      the same and the scale does not depend on the lengths sampled.

    Rows without any policy token are ignored (they neither count nor contribute); a batch without
    any gives 0, whether the counts are this batch's or passed in.

    Micro-batches: by default the counts come from this batch. To split a mini-batch into micro-batches
    and get *exactly* the gradient of the whole, pass the whole mini-batch's counts (from
    :func:`loss_normalizers`) to every micro-batch and **sum** (do not average) the micro-batch losses,
    as plain gradient accumulation does. All three modes are then split-invariant.

    Args:
        loss: (B, L) per-token loss. loss_mask: (B, L), 1 on policy tokens.
        num_tokens, num_seqs: global counts (see above). norm_length: required for the third mode.
    Returns:
        A scalar tensor.
    """
    _check_same_shape(loss=loss, loss_mask=loss_mask)
    if loss.dim() != 2:
        raise ValueError(f"loss must be (B, L), got {tuple(loss.shape)}")
    m = (loss_mask != 0).to(loss.dtype)
    # where(), not a product, so that a NaN/inf in a masked-out position cannot leak into the sum.
    masked = torch.where(loss_mask != 0, loss, torch.zeros_like(loss))
    if mode == "token-mean":
        denom = m.sum().clamp_min(1) if num_tokens is None else max(num_tokens, 1)
        return masked.sum() / denom
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
    seq_tokens = m.sum(dim=-1)
    n_seqs = (seq_tokens > 0).sum().clamp_min(1) if num_seqs is None else max(num_seqs, 1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / seq_tokens.clamp_min(1)
        return per_seq.sum() / n_seqs
    if norm_length is None or not norm_length > 0:  # also refuses NaN
        raise ValueError("seq-mean-token-sum-norm needs norm_length > 0: a constant such as the maximum "
                         "response length (not the padded width of this batch, which varies)")
    return masked.sum() / (n_seqs * norm_length)


# --------------------------------------------------------------------------------------------------
# The whole GRPO loss and its metrics


@dataclass
class GRPOLossConfig:
    """Hyperparameters of :func:`grpo_loss`. Defaults follow the GRPO paper (clip 0.2, k3, KL 0.04);
    DAPO uses ``clip_high=0.28`` and ``kl_coef=0``; Dr. GRPO uses ``agg_mode="seq-mean-token-sum-norm"``."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.04
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    agg_mode: str = "token-mean"
    max_log_ratio: float = 20.0
    tis_cap: float = 0.0


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, ref_logp: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None, config: GRPOLossConfig | None = None,
              num_tokens: int | None = None, num_seqs: int | None = None,
              norm_length: int | None = None,
              behaviour_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's GRPO loss: clipped policy loss + ``kl_coef`` * KL(pi || pi_ref)
    - ``entropy_coef`` * entropy, each aggregated over the masked tokens with the same mode.

    Args:
        logp, old_logp, loss_mask: (B, L). advantages: (B,) or (B, L). ref_logp: (B, L) or None (then
        no KL term, whatever ``kl_coef``). entropy: (B, L) or None (only for the metric and the bonus).
        num_tokens, num_seqs, norm_length: see :func:`aggregate_loss`.
        behaviour_logp: (B, L) or None: the sampling log-probs when ``old_logp`` is the learner's own;
            each token's policy loss is then weighted by :func:`behaviour_weights` (truncated at
            ``config.tis_cap`` when > 0), and the metrics get ``tis_clip_frac`` and ``tis_weight_mean``.
    Returns:
        ``(loss, metrics)``: the scalar loss and a dict of floats for this micro-batch (pg_loss, kl,
        clip fractions, approximate KL to the old policy, entropy, ratio and advantage statistics).
    """
    cfg = config or GRPOLossConfig()
    if advantages.dim() == 1:
        advantages = token_advantages(advantages, loss_mask)
    agg = dict(mode=cfg.agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    pl = policy_loss(logp, old_logp, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                     cfg.max_log_ratio)
    metrics: dict[str, float] = {}
    if behaviour_logp is not None:
        w, truncated = behaviour_weights(old_logp, behaviour_logp, cfg.tis_cap, cfg.max_log_ratio)
        pl.loss = pl.loss * w
        mf = (loss_mask != 0).to(w.dtype)
        metrics["tis_clip_frac"] = float(masked_mean(truncated.to(w.dtype), mf))
        metrics["tis_weight_mean"] = float(masked_mean(w, mf))
    pg = aggregate_loss(pl.loss, loss_mask, **agg)
    loss = pg
    if ref_logp is not None and cfg.kl_coef != 0:
        kl = aggregate_loss(kl_penalty(logp, ref_logp, cfg.kl_kind, cfg.max_log_ratio), loss_mask, **agg)
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = float(kl.detach())
    if entropy is not None and cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * aggregate_loss(entropy, loss_mask, **agg)
    metrics["pg_loss"] = float(pg.detach())
    metrics.update(policy_metrics(logp, old_logp, advantages, loss_mask, pl, entropy))
    metrics["loss"] = float(loss.detach())
    return loss, metrics


@torch.no_grad()
def policy_metrics(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, out: PolicyLossOutput,
                   entropy: torch.Tensor | None = None) -> dict[str, float]:
    """Per-step diagnostics over the masked tokens (all (B, L) inputs), as floats.

    ``clip_frac`` (and its ``_low`` / ``_high`` parts): fraction of tokens whose clipped branch is
    active. ``approx_kl``: mean k3 estimate of KL(pi_old || pi) from the old policy's samples (Schulman
    2020), the usual early-stopping signal; ``approx_kl_k1`` the plain mean of ``old_logp - logp``."""
    m = loss_mask != 0
    mf = m.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20, 20)
    res = {
        "clip_frac": float(masked_mean((out.clipped_low | out.clipped_high).to(mf.dtype), mf)),
        "clip_frac_low": float(masked_mean(out.clipped_low.to(mf.dtype), mf)),
        "clip_frac_high": float(masked_mean(out.clipped_high.to(mf.dtype), mf)),
        "dual_clip_frac": float(masked_mean(out.dual_clipped.to(mf.dtype), mf)),
        "approx_kl": float(masked_mean(torch.expm1(log_ratio) - log_ratio, mf)),
        "approx_kl_k1": float(masked_mean(-log_ratio, mf)),
        "ratio_mean": float(masked_mean(out.ratio, mf)),
        "ratio_max": float(out.ratio[m].max()) if m.any() else 1.0,
        "num_tokens": float(mf.sum()),
    }
    adv = advantages[m] if advantages.dim() == 2 else advantages
    if adv.numel():
        res.update(adv_mean=float(adv.mean()), adv_std=float(adv.std()) if adv.numel() > 1 else 0.0,
                   adv_min=float(adv.min()), adv_max=float(adv.max()))
    if entropy is not None:
        res["entropy"] = float(masked_mean(entropy.detach(), mf))
    return res


@torch.no_grad()
def _group_range(rewards: torch.Tensor, group_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's group index 0..n-1, each group's min reward, each group's max reward)."""
    group_ids = torch.as_tensor(group_ids)
    # as in group_advantages: a reward without its group id (or the reverse) would be paired with
    # another row's, and a NaN reward would make its group look uniform
    if rewards.dim() != 1 or group_ids.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be (B,), got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    rmax = torch.full((n_groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inv, rewards, "amax")
    rmin = torch.full((n_groups,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, inv, rewards, "amin")
    return inv, rmin, rmax


def rows_with_signal(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the trajectory's group has rewards that differ, so its advantages are not all zero
    (DAPO's dynamic-sampling filter keeps only these groups)."""
    inv, rmin, rmax = _group_range(torch.as_tensor(rewards, dtype=torch.float64), group_ids)
    return (rmax > rmin)[inv]


@torch.no_grad()
def reward_metrics(rewards: torch.Tensor, group_ids: torch.Tensor,
                   advantages: torch.Tensor | None = None) -> dict[str, float]:
    """Reward and advantage statistics of a rollout batch: mean, std (unbiased), min, max, the number of
    groups and the fraction of groups whose rewards are all equal (they give no gradient in GRPO).

    rewards, group_ids, advantages: (B,)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.numel() == 0:
        raise ValueError("reward_metrics needs at least one reward, got none")
    _, rmin, rmax = _group_range(rewards, group_ids)
    n_groups = len(rmax)
    res = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward_min": float(rewards.min()),
        "reward_max": float(rewards.max()),
        "num_groups": float(n_groups),
        "frac_groups_no_signal": float((rmax == rmin).double().mean()) if n_groups else 0.0,
    }
    if advantages is not None:
        a = torch.as_tensor(advantages, dtype=torch.float64)
        res.update(adv_mean=float(a.mean()), adv_std=float(a.std()) if a.numel() > 1 else 0.0,
                   adv_min=float(a.min()), adv_max=float(a.max()))
    return res


# --------------------------------------------------------------------------------------------------
# Token log-probs from the final hidden states


def naive_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path: full ``(..., V)`` logits in float32, ``log_softmax``, gather. Same contract as
    :func:`token_logprobs` (used by the tests and the benchmark; memory O(B * L * V))."""
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    logp_all = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    logp = logp_all.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, torch.zeros_like(logp)), entropy


class _ChunkedLogprobs(torch.autograd.Function):
    """Per-token log-prob and entropy over row chunks; never more than ``chunk`` rows of logits alive.

    Backward recomputes each chunk's logits (like checkpointing) unless ``grad_in_forward``: then the
    forward also computes ``(onehot - p) @ W`` per token, which is all the hidden states' gradient
    needs when neither the weight nor the entropy needs one (frozen output layer, e.g. LoRA), and the
    backward is a per-token scaling with no recompute."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, entropy_grad, grad_in_forward):
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float64 stays float64 (gradcheck)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse_all = torch.empty_like(logp)
        unit_grad = torch.empty(n, hidden.shape[1], dtype=acc, device=hidden.device) \
            if grad_in_forward else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = (hidden[s:e] @ weight.T).to(acc)  # (c, V)
            lse = torch.logsumexp(z, dim=-1)
            z.sub_(lse[:, None])  # now log p, in place to keep one (c, V) buffer
            idx = labels[s:e, None]
            logp[s:e] = z.gather(1, idx).squeeze(1)
            p = z.exp()
            entropy[s:e] = -torch.einsum("cv,cv->c", p, z)
            lse_all[s:e] = lse
            if grad_in_forward:
                del z
                p.neg_().scatter_add_(1, idx, torch.ones_like(idx, dtype=p.dtype))  # onehot - p
                unit_grad[s:e] = (p.to(weight.dtype) @ weight).to(acc)
            del p
        ctx.chunk, ctx.entropy_grad, ctx.grad_in_forward = chunk, entropy_grad, grad_in_forward
        if grad_in_forward:
            ctx.save_for_backward(unit_grad)
        else:
            ctx.save_for_backward(hidden, weight, labels, lse_all, entropy)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        if ctx.grad_in_forward:
            (unit_grad,) = ctx.saved_tensors
            return g_logp[:, None] * unit_grad, None, None, None, None, None
        hidden, weight, labels, lse_all, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_ent = ctx.entropy_grad and g_ent is not None
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=lse_all.dtype, device=weight.device) if need_w else None
        if g_logp is None:
            g_logp = torch.zeros_like(lse_all)
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, hidden.shape[0])
            h = hidden[s:e]
            z = (h @ weight.T).to(lse_all.dtype).sub_(lse_all[s:e, None])  # log p
            p = z.exp()
            # d logp_label / dz = onehot - p ; d entropy / dz = -p * (log p + H)
            if use_ent:
                g = z.add_(entropy[s:e, None]).mul_(p).mul_(-g_ent[s:e, None])
                g.sub_(p.mul_(g_logp[s:e, None]))
                del p
            else:
                g = p.mul_(-g_logp[s:e, None])
                del z
            g.scatter_add_(1, labels[s:e, None], g_logp[s:e, None].to(g.dtype))
            g = g.to(weight.dtype)
            if need_h:
                g_h[s:e] = g @ weight
            if need_w:
                g_w.addmm_(g.T.to(g_w.dtype), h.to(g_w.dtype))
            del g
        return g_h, (g_w.to(weight.dtype) if need_w else None), None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 512,
                   ignore_index: int = -100, entropy_grad: bool = False,
                   grad_in_forward: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``labels`` and entropy of the softmax over ``hidden @ weight.T``, per token, without
    the full-vocabulary logits in memory.

    Rows are processed ``chunk_size`` at a time; only the (chunk_size, V) float32 logits of one chunk
    exist at once (forward and backward), instead of the (B * L, V) logits, their log-softmax and their
    gradient. Backward recomputes a chunk's logits from the saved hidden states (FLOPs of one extra
    matmul; same numbers as the naive path up to float rounding).

    ``labels[b, t]`` is the token whose log-prob is wanted at ``hidden[b, t]``: for a causal LM that is
    the *next* token, see :func:`causal_token_logprobs`. Positions with ``ignore_index`` get log-prob 0
    and no gradient from it.

    Args:
        hidden: (B, L, H) or (N, H) final hidden states (after the last norm).
        weight: (V, H) output layer (``lm_head.weight``); float32 or bfloat16.
        labels: (B, L) or (N,) int64 token ids in [0, V), or ``ignore_index``.
        chunk_size: rows per chunk; memory ~ 3 * chunk_size * V * 4 bytes in backward.
        entropy_grad: whether the entropy is differentiable (an entropy bonus); by default it is a
            metric and returned without grad, which lets the frozen-weight fast path below apply.
        grad_in_forward: None (auto): when the hidden states need a gradient but the weight and the
            entropy do not, the forward also computes the hidden gradient's per-token direction (one
            extra matmul in forward, none in backward) and saves (N, H) instead of recomputing. This
            saves one matmul per step in that case. False forces recompute.
    Returns:
        ``(logp, entropy)`` with the shape of ``labels``, float32 (float64 for float64 inputs).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden (..., H) and labels (...) must agree, got {tuple(hidden.shape)} and "
                         f"{tuple(labels.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H={hidden.shape[-1]}), got {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} vs {weight.dtype}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    out_shape = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1).long()
    valid = lab != ignore_index
    bad = valid & ((lab < 0) | (lab >= weight.shape[0]))
    if bad.any():
        raise ValueError(f"labels outside [0, {weight.shape[0]}) (and not ignore_index={ignore_index}): "
                         f"{lab[bad][:5].tolist()}")
    safe = torch.where(valid, lab, torch.zeros_like(lab))
    grad_on = torch.is_grad_enabled()
    if grad_in_forward is None:
        grad_in_forward = grad_on and h2.requires_grad and not weight.requires_grad and not entropy_grad
    elif grad_in_forward and (weight.requires_grad or entropy_grad):
        raise ValueError("grad_in_forward needs a frozen weight and entropy_grad=False")
    logp, entropy = _ChunkedLogprobs.apply(h2, weight, safe, int(chunk_size), bool(entropy_grad),
                                           bool(grad_in_forward))
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    return logp.reshape(out_shape), entropy.reshape(out_shape)


def causal_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                          chunk_size: int = 512, entropy_grad: bool = False,
                          grad_in_forward: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift-by-one for causal LMs: the log-prob of ``input_ids[:, t]`` comes from ``hidden[:, t - 1]``.

    The outputs are aligned with ``input_ids`` (the rollout batch's convention for ``old_logprobs``
    and ``loss_mask``): ``logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` for ``t >= 1``,
    ``entropy[:, t]`` is the entropy of that same next-token distribution, and column 0 (no context)
    is 0 in both. The last hidden state predicts a token beyond the sequence and is not used.
    In packed rows the first token of each trajectory is "predicted" from the previous trajectory's
    last state: it is a prompt token, so the loss mask must be 0 there (it is, in a rollout batch).

    hidden: (B, L, H); weight: (V, H); input_ids: (B, L). Returns ``(logp, entropy)``, (B, L) float32.
    """
    if hidden.dim() != 3 or input_ids.shape != hidden.shape[:2]:
        raise ValueError(f"need hidden (B, L, H) and input_ids (B, L), got {tuple(hidden.shape)} and "
                         f"{tuple(input_ids.shape)}")
    logp, ent = token_logprobs(hidden[:, :-1], weight, input_ids[:, 1:], chunk_size=chunk_size,
                               entropy_grad=entropy_grad, grad_in_forward=grad_in_forward)
    return F.pad(logp, (1, 0)), F.pad(ent, (1, 0))
