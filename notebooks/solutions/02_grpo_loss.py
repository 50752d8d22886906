# %% [markdown]
# # Solutions · 02 The GRPO loss
#
# Run the cells in order; each prints what the exercise asks you to look for. Try the exercise in the
# lesson first. Takes a few seconds.

# %%
import torch

from sinkflex_core import grpo

# %% [markdown]
# ## Exercise 1 · A group with equal rewards, and a lone success
#
# Section 1 with `rewards` set to eight equal values, then to one success among failures and one failure
# among successes.

# %%
group = torch.zeros(8, dtype=torch.long)
cases = {"all solved": [1.0] * 8, "all failed": [0.0] * 8,
         "one success in 8": [1.0] + [0.0] * 7, "one failure in 8": [0.0] + [1.0] * 7}
for name, values in cases.items():
    r = torch.tensor(values)
    adv = grpo.group_advantages(r, group, eps=1e-6)
    adv_dr = grpo.group_advantages(r, group, norm_by_std=False)
    print(f"{name:17s} GRPO: odd one {adv[0]:+.3f}, others {adv[1]:+.3f} | "
          f"Dr. GRPO: odd one {adv_dr[0]:+.3f}, others {adv_dr[1]:+.3f}")
    if name.startswith("all"):
        assert adv.abs().max() == 0 and adv_dr.abs().max() == 0

# %% [markdown]
# A group whose attempts all got the same reward gives every trajectory an advantage of exactly 0: it
# teaches nothing, however many tokens it holds (this is why training logs the fraction of such groups).
# A lone success gets +2.475 under GRPO but +0.875 under Dr. GRPO: dividing by the group's small standard
# deviation (0.354) makes a rare outcome count as much as a common one, which speeds learning on hard
# tasks and amplifies noise on easy ones. Dr. GRPO keeps the advantage in reward units.

# %% [markdown]
# ## Exercise 2 · GRPO and Dr. GRPO aggregation on a short and a long trajectory
#
# Section 4 with `lengths = [16, 512]`, both trajectories wrong (advantage -1): the weight each token's
# loss gets in the aggregated loss, from autograd as in the lesson.

# %%
lengths = [16, 512]
L = max(lengths)
m = torch.zeros(len(lengths), L)
for b, n in enumerate(lengths):
    m[b, :n] = 1
print(f"{'mode':>24}  {'one token, short':>16}  {'one token, long':>15}  {'short / long':>12}")
per_token_weight = {}
for mode in grpo.AGG_MODES:
    per_token = torch.ones(len(lengths), L, requires_grad=True)
    grpo.aggregate_loss(per_token, m, mode, norm_length=L).backward()
    short, long = float(per_token.grad[0, 0]), float(per_token.grad[1, 0])
    per_token_weight[mode] = short / long
    print(f"{mode:>24}  {short:16.5f}  {long:15.5f}  {short / long:12.1f}")
assert round(per_token_weight["seq-mean-token-mean"]) == 512 // 16
assert round(per_token_weight["seq-mean-token-sum-norm"]) == 1

# %% [markdown]
# Under the GRPO paper's `seq-mean-token-mean` every trajectory weighs the same, so each token of the
# 512-token wrong answer is pushed down 32 times less than a token of the 16-token one: being long and
# wrong is cheap, and the policy drifts towards long wrong answers (Dr. GRPO's length bias). With
# `seq-mean-token-sum-norm` (and `token-mean`) every token weighs the same whatever its trajectory's length.

# %% [markdown]
# ## Exercise 3 · The clip band on a ratio of 1.5
#
# Section 2's number cell with one ratio, 1.5, for A = +1 and A = -1, at `clip_high` 0.2, 0.28 and 0.6:
# the loss and its gradient with respect to the token's log-prob.

# %%
for clip_high in (0.2, 0.28, 0.6):
    for a in (1.0, -1.0):
        logp = torch.tensor([[1.5]]).log().requires_grad_()
        out = grpo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([a]), clip_low=0.2, clip_high=clip_high)
        out.loss.sum().backward()
        clipped = bool(out.clipped_high[0, 0] or out.clipped_low[0, 0])
        print(f"clip_high {clip_high:4.2f}  A={a:+.0f}: loss {float(out.loss.detach()):+.3f}, clipped {clipped!s:5s}, "
              f"d loss / d logp {float(logp.grad):+.3f}")
        if a > 0:
            assert clipped == (1.5 > 1 + clip_high)
        else:
            assert not clipped and float(logp.grad) > 0

# %% [markdown]
# With A = +1 the token's probability has already grown 1.5 times: above `1 + clip_high` (0.2 or 0.28) it
# is clipped and its gradient is 0, so one update cannot push a good token arbitrarily far. Only a band
# wide enough (0.6) lets it keep growing. With A = -1 nothing is clipped at 1.5: the loss is the larger of
# the two branches, so a bad token whose probability went *up* always gets the full gradient pushing it
# back down. The clip only stops moves in the direction the advantage asks for.
