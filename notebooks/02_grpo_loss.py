# %% [markdown]
# # 02 · The GRPO loss, from a group's rewards to the clipped objective
#
# GRPO trains without a value model: for each task the policy samples a group of G = 8 trajectories,
# and each one's advantage is its reward relative to the group's. This notebook walks through
# `sinkflex_core.grpo` one formula at a time: group advantages (GRPO and Dr. GRPO), the clipped
# surrogate with separate low / high clips and the dual clip, the k1 / k2 / k3 KL estimators, how the
# three loss aggregation modes weigh short and long trajectories, why micro-batches need global
# counts, and the memory-light per-token log-probs.
#
# **Needs:** CPU. **Takes:** a few seconds (smoke mode and default alike). Writes two figures to
# `figures/` (`grpo_clipped_surrogate.png`, `grpo_aggregation_weights.png`).

# %% tags=["parameters"]
smoke = False  # True: the quick mode the test suite uses (this notebook is quick either way)
seed = 0

# %%
from sinkflex_core.notebooks import resolve_smoke

smoke = resolve_smoke(smoke)

# %%
import matplotlib.pyplot as plt
import torch

from sinkflex_core import grpo
from sinkflex_core.paths import figures_dir

torch.manual_seed(seed)

# %% [markdown]
# ## 1. Rewards of a group of 8 -> advantages
#
# Eight attempts at one retail task: three solved it (reward 1), one got partial credit, four failed.
# GRPO (DeepSeekMath) normalises within the group: `A = (r - mean) / (std + eps)`, with the unbiased
# std (N - 1), as verl, TRL and OpenRLHF do. Dr. GRPO drops the division by the std: only centring.
# The advantages of a group always sum to zero.

# %%
# NBVAL_CHECK_OUTPUT
rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0])
group = torch.zeros(8, dtype=torch.long)
adv = grpo.group_advantages(rewards, group, eps=1e-6)
adv_dr = grpo.group_advantages(rewards, group, norm_by_std=False)
print(f"mean {rewards.mean():.4f}, unbiased std {rewards.std():.4f}")
print("trajectory  reward  GRPO adv  Dr.GRPO adv")
for i in range(8):
    print(f"{i:>10}  {rewards[i]:6.2f}  {adv[i]:8.4f}  {adv_dr[i]:11.4f}")
print("advantages sum to zero:", abs(float(adv.sum())) < 1e-6)

# %% [markdown]
# A group where every attempt got the same reward (all solved, or all failed) carries no signal; so
# does a group of one. Both give exactly zero, never NaN, even with `eps=0`:

# %%
# NBVAL_CHECK_OUTPUT
print(grpo.group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0]),
                            torch.tensor([0, 0, 0, 0, 1, 2]), eps=0.0))
print(grpo.reward_metrics(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])))

# %% [markdown]
# The advantage of a trajectory reaches its tokens through the loss mask: only the tokens the policy
# wrote (mask 1) get it, the customer's and the tools' replies (mask 0) get nothing.

# %%
# NBVAL_CHECK_OUTPUT
mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0]])  # prompt, policy turn, tool reply, policy turn, pad
print(grpo.token_advantages(adv[:1], mask))

# %% [markdown]
# ## 2. The clipped surrogate
#
# Per token, with `ratio = pi / pi_old`, the loss is `max(-A * ratio, -A * clip(ratio, 1 - eps_low,
# 1 + eps_high))`. Below, the *objective* (minus the loss) as a function of the ratio: for A > 0 it
# stops growing above `1 + eps_high` (no incentive to move further), for A < 0 it stops improving below
# `1 - eps_low`. DAPO's clip-higher (eps_high = 0.28 > 0.2) leaves more room to raise the probability
# of rare good tokens. The dual clip (c = 3) bounds the loss of a bad action whose ratio exploded.

# %%
ratio = torch.linspace(0.01, 4.0, 400)
logp = ratio.log()[None]
old = torch.zeros_like(logp)
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
for ax, a in zip(axes, (1.0, -1.0)):
    A = torch.tensor([a])
    ax.plot(ratio, a * ratio, color="0.6", ls=":", label="unclipped  A * ratio")
    for lo, hi, dual, style in ((0.2, 0.2, None, "-"), (0.2, 0.28, None, "--"), (0.2, 0.28, 3.0, "-.")):
        if dual is not None and a > 0:
            continue  # the dual clip only touches negative advantages
        obj = -grpo.policy_loss(logp, old, A, clip_low=lo, clip_high=hi, dual_clip=dual).loss[0]
        lab = f"clip {lo}/{hi}" + (f", dual clip {dual:g}" if dual else "")
        ax.plot(ratio, obj, ls=style, label=lab)
    ax.axvline(1.0, color="0.85", lw=0.8)
    ax.set_title(f"advantage A = {a:+g}")
    ax.set_xlabel("ratio pi / pi_old")
    ax.set_ylabel("objective  (= -loss)")
    ax.legend(fontsize=8)
fig.suptitle("Clipped surrogate objective per token")
fig.tight_layout()
fig.savefig(figures_dir() / "grpo_clipped_surrogate.png", dpi=120)
plt.show()

# %% [markdown]
# The same in numbers, with clip 0.2 / 0.28 and dual clip 3: the clipped tokens get no gradient
# (their loss does not depend on the current policy), which `clip_frac` counts.

# %%
# NBVAL_CHECK_OUTPUT
r = torch.tensor([0.5, 0.9, 1.1, 1.5, 4.0])
lp = r.log().repeat(2, 1)
out = grpo.policy_loss(lp, torch.zeros_like(lp), torch.tensor([1.0, -1.0]), 0.2, 0.28, dual_clip=3.0)
print("ratio        ", [f"{x:5.2f}" for x in r.tolist()])
print("loss  A=+1   ", [f"{x:5.2f}" for x in out.loss[0].tolist()])
print("loss  A=-1   ", [f"{x:5.2f}" for x in out.loss[1].tolist()])
print("clipped A=+1 ", out.clipped_high[0].tolist())
print("clipped A=-1 ", (out.clipped_low[1] | out.dual_clipped[1]).tolist())

# %% [markdown]
# ## 3. KL to the reference policy
#
# GRPO adds `beta * KL(pi || pi_ref)` to the loss (beta = 0.04 in the paper), estimated per token from
# the sampled tokens. With `x = log pi_ref - log pi`: k1 = -x (unbiased, noisy, can be negative),
# k2 = x^2 / 2 (low variance, biased), k3 = e^x - x - 1 (unbiased and >= 0: the paper's choice).
# Averaged under pi over a small vocabulary, k1 and k3 give the exact KL; k2 only approximately:

# %%
# NBVAL_CHECK_OUTPUT
p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
print(f"exact KL(p || q) = {(p * (p / q).log()).sum():.6f}")
for kind in grpo.KL_KINDS:
    est = (p * grpo.kl_penalty(p.log(), q.log(), kind, max_value=None)).sum()
    print(f"E_p[{kind}]        = {est:.6f}")

# %% [markdown]
# ## 4. How the aggregation modes weigh short and long trajectories
#
# The per-token losses are reduced to one number in one of three ways. The weight each token gets is
# the derivative of the aggregated loss with respect to that token's loss; autograd gives it directly.
# Eight trajectories of 8 to 512 policy tokens:
#
# - `token-mean`: every token weighs 1 / (all tokens): a long trajectory counts in proportion to its
#   length (DAPO; verl's and TRL's default).
# - `seq-mean-token-mean`: every trajectory weighs the same, so a token of a short trajectory weighs
#   far more than one of a long trajectory (the GRPO paper's formula). With a negative advantage this
#   is what lets long wrong answers off lightly: Dr. GRPO's "length bias".
# - `seq-mean-token-sum-norm`: every token weighs 1 / (trajectories x a constant length), like
#   token-mean, but the scale no longer depends on which lengths were sampled (Dr. GRPO).

# %%
lengths = [8, 16, 32, 64, 128, 192, 256, 512]
L = max(lengths)
m = torch.zeros(len(lengths), L)
for b, n in enumerate(lengths):
    m[b, :n] = 1
weights = {}
for mode in grpo.AGG_MODES:
    per_token = torch.ones(len(lengths), L, requires_grad=True)
    grpo.aggregate_loss(per_token, m, mode, norm_length=L).backward()
    weights[mode] = per_token.grad
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
for mode, w in weights.items():
    axes[0].plot(lengths, w[:, 0] * 1e3, "o-", label=mode)
    axes[1].plot(lengths, w.sum(1), "o-", label=mode)
axes[0].set(xscale="log", yscale="log", xlabel="trajectory length (policy tokens)",
            ylabel="weight of one token (x 1e-3)", title="per token")
axes[1].set(xscale="log", xlabel="trajectory length (policy tokens)", ylabel="total weight of the trajectory",
            title="per trajectory")
axes[0].legend(fontsize=8)
fig.suptitle("Loss aggregation: weight of short vs long trajectories (8 trajectories)")
fig.tight_layout()
fig.savefig(figures_dir() / "grpo_aggregation_weights.png", dpi=120)
plt.show()

# %%
# NBVAL_CHECK_OUTPUT
print("length  " + "  ".join(f"{mode:>24}" for mode in weights))
for b, n in enumerate(lengths):
    print(f"{n:>6}  " + "  ".join(f"{float(w[b].sum()):24.4f}" for w in weights.values()))

# %% [markdown]
# ## 5. Micro-batches: normalise by the whole mini-batch's counts
#
# A step's mini-batch is often split into micro-batches whose gradients are accumulated. Averaging
# micro-batch losses that were each normalised by their *own* token count is not the mini-batch's
# loss. Passing the mini-batch's counts (`loss_normalizers`) to every micro-batch and summing is exact,
# for all three modes (the test suite checks the gradients too).

# %%
# NBVAL_CHECK_OUTPUT
per_token = torch.rand(len(lengths), L, generator=torch.Generator().manual_seed(seed))
counts = grpo.loss_normalizers(m)
print(counts)
for mode in grpo.AGG_MODES:
    whole = grpo.aggregate_loss(per_token, m, mode, norm_length=L)
    parts = [slice(0, 3), slice(3, 8)]
    summed = sum(grpo.aggregate_loss(per_token[s], m[s], mode, norm_length=L, **counts) for s in parts)
    averaged = sum(grpo.aggregate_loss(per_token[s], m[s], mode, norm_length=L) for s in parts) / len(parts)
    print(f"{mode:>24}: whole {whole:.5f}  global counts {summed:.5f}  local + average {averaged:.5f}")

# %% [markdown]
# ## 6. The whole loss, with its metrics
#
# `grpo_loss` puts the pieces together for one micro-batch: clipped policy loss + 0.04 x k3 KL,
# aggregated with one mode, and returns the per-step metrics (clip fractions, approximate KL to the
# sampling policy, entropy, advantage statistics).

# %%
# NBVAL_CHECK_OUTPUT
g = torch.Generator().manual_seed(seed)
B, T = 8, 24
loss_mask = torch.zeros(B, T)
for b in range(B):
    loss_mask[b, 4: 4 + 4 + 2 * b] = 1
old_logp = -torch.rand(B, T, generator=g) * 2 * loss_mask
logp = (old_logp + 0.3 * torch.randn(B, T, generator=g) * loss_mask).requires_grad_()
ref_logp = old_logp + 0.1 * torch.randn(B, T, generator=g) * loss_mask
loss, metrics = grpo.grpo_loss(logp, old_logp, adv, loss_mask, ref_logp=ref_logp,
                               config=grpo.GRPOLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.04))
loss.backward()
for k, v in metrics.items():
    print(f"{k:>16}: {v:+.4f}")

# %% [markdown]
# ## 7. Per-token log-probs without the full-vocabulary logits
#
# A GRPO step needs `log pi(token)` at every position. The naive way builds the `(L, V)` logits in
# float32: at 8,192 tokens and Qwen2.5's 152,064-token vocabulary that is 4.6 GiB per copy, and
# `log_softmax` and the backward make several copies. `token_logprobs` takes the final hidden states
# and the output layer and works through the rows in chunks, recomputing each chunk's logits in the
# backward; only one chunk of logits exists at a time. For a causal LM, `causal_token_logprobs` does
# the shift: the log-prob of token t comes from hidden state t - 1, and column 0 is 0.
# Same numbers as the naive path, values and gradients:

# %%
# NBVAL_CHECK_OUTPUT
H, V = 64, 4096
h = torch.randn(2, 300, H, generator=g, requires_grad=True)
w = (torch.randn(V, H, generator=g) * 0.2).requires_grad_()
ids = torch.randint(0, V, (2, 300), generator=g)
lp_c, ent_c = grpo.causal_token_logprobs(h, w, ids, chunk_size=128)
lp_c.sum().backward()
gh_c, gw_c = h.grad.clone(), w.grad.clone()
h.grad = w.grad = None
lp_n, ent_n = grpo.naive_token_logprobs(h[:, :-1], w, ids[:, 1:])
lp_n.sum().backward()


def rel(a, b):
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


errors = {"logp": rel(lp_c[:, 1:], lp_n), "entropy": rel(ent_c[:, 1:], ent_n),
          "grad hidden": rel(gh_c, h.grad), "grad weight": rel(gw_c, w.grad)}
# float32 rounding (errors about 1e-7 to 1e-6) differs between CPUs: five decimals are what is stable
print("relative error, chunked vs naive:", {k: f"{v:.5f}" for k, v in errors.items()})
assert max(errors.values()) < 1e-5, errors
print("all below 1e-5")

# %% [markdown]
# What each path keeps for the backward, counted rather than computed from a formula: autograd's
# saved-tensor hooks see every tensor stored for the backward, and the cell adds up the distinct
# storages (the inputs `h` and `w` left out). The naive path keeps the float32 logits and their
# `log_softmax`, two `(L, V)` copies, so it grows with L x V; the chunked path keeps a few numbers per
# token and recomputes each chunk's logits in the backward. (These are byte counts, so they do not vary
# between machines; `benchmarks/bench_logprobs.py` measures the peak of a whole forward + backward.)

# %%
# NBVAL_CHECK_OUTPUT
def kept_for_backward(fn, *args):
    """MiB of the distinct storages that autograd saves while ``fn(*args)`` runs, the args' own left out."""
    kept, skip = {}, {t.untyped_storage().data_ptr() for t in args}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(n for ptr, n in kept.items() if ptr not in skip) / 2**20


print(f"vocabulary V = {V}, hidden size H = {H}")
print(f"{'tokens':>7} {'one (L, V) copy MiB':>20} {'naive keeps MiB':>16} {'chunked keeps MiB':>18}")
for n in (512, 2048, 4096):
    hn = torch.randn(1, n, H, generator=g, requires_grad=True)
    idn = torch.randint(0, V, (1, n), generator=g)
    naive = kept_for_backward(grpo.naive_token_logprobs, hn[:, :-1], w, idn[:, 1:])
    chunked = kept_for_backward(grpo.causal_token_logprobs, hn, w, idn)
    print(f"{n:>7} {(n - 1) * V * 4 / 2**20:20.2f} {naive:16.2f} {chunked:18.3f}")

# %% [markdown]
# ## Exercises
#
# Change one thing, run the cells again, and look for what each exercise names.
#
# 1. **A group with equal rewards, and a lone success.** In section 1 set `rewards` to eight 1.0 (then eight
#    0.0), then to one 1.0 among seven 0.0, and compare the GRPO and Dr. GRPO advantages. What does a group
#    of equal rewards teach the policy, and how does dividing by the group's std change the weight of a rare
#    success?
# 2. **A long and a short wrong answer.** In section 4 set `lengths = [16, 512]` and compare the weight of
#    one token of each trajectory under `seq-mean-token-mean` (GRPO) and `seq-mean-token-sum-norm`
#    (Dr. GRPO). With a negative advantage, whose tokens are pushed down less, and what would a policy learn
#    from that?
# 3. **The clip band on a ratio of 1.5.** In the numbers cell of section 2 set `r = torch.tensor([1.5])` and
#    try `clip_high` 0.2, 0.28 and 0.6. Which of A = +1 and A = -1 is clipped, and which still gets a
#    gradient (call `lp.requires_grad_()` first, then `out.loss.sum().backward()` and read `lp.grad`)?
#
# Solutions: [`solutions/02_grpo_loss.py`](solutions/02_grpo_loss.py), one cell per exercise that runs and prints what to look for (JupyterLab with jupytext opens it as a notebook; or `jupytext --to ipynb notebooks/solutions/02_grpo_loss.py`).
