# %% [markdown]
# # Solutions · 04 Multi-turn rollouts
#
# The first cell rebuilds the lesson's tiny policy with the lesson's oracle data and supervised warm-up
# (most of the lesson's 2 to 3 minutes on 2 idle cores; seconds in smoke mode), then each exercise plays three
# groups of rollouts with one setting changed. Try the exercise in the lesson first.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")
import dataclasses
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from sinkflex_core.models import build_model, get_tokenizer, tiny_qwen2_config
from sinkflex_core.notebooks import resolve_smoke
from sinkflex_core.rollout import AgentBackend, HFBackend, RolloutConfig, collect_rollouts

smoke = resolve_smoke(False)
seed, task_index = 0, 0
sft_steps = 4 if smoke else 120
max_new_tokens_per_turn = 40 if smoke else 96
ENV, SYSTEM = "sinkflex/Retail-v0", "You are the store's assistant."

tok = get_tokenizer()
expert_cfg = RolloutConfig(group_size=1, max_turns=30, max_total_tokens=2048, max_new_tokens_per_turn=256,
                           system_prompt=SYSTEM, include_tools=False, seed=seed)
expert = collect_rollouts(AgentBackend(tok), tok, ENV, list(range(100, 100 + (4 if smoke else 64))), "train",
                          expert_cfg)
policy = build_model(tiny_qwen2_config(len(tok), tokenizer=tok), seed=seed)
opt = torch.optim.AdamW(policy.parameters(), lr=2e-3, weight_decay=0.0)
rng = np.random.default_rng(seed)
policy.train()
for _ in range(sft_steps):  # the lesson's warm-up, unchanged
    rows = torch.as_tensor(rng.choice(len(expert), size=2 if smoke else 4, replace=False))
    n = min(int(expert.lengths()[rows].max()), 512 if smoke else 1024)
    ids, att, lm = expert.input_ids[rows, :n], expert.attention_mask[rows, :n], expert.loss_mask[rows, :n]
    logits = policy(ids, attention_mask=att).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    loss = (nll * lm[:, 1:].reshape(-1)).sum() / lm[:, 1:].sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
policy.eval()
print(f"warmed up for {sft_steps} steps, last loss on policy tokens {loss.item():.3f}")

base = RolloutConfig(group_size=8, max_turns=2 if smoke else 6, max_total_tokens=1536,
                     max_new_tokens_per_turn=max_new_tokens_per_turn, temperature=1.0, top_p=1.0,
                     system_prompt=SYSTEM, include_tools=False, seed=seed)


def play(**changes):
    """One group of the lesson's task with some settings of the lesson's RolloutConfig changed."""
    backend = HFBackend(policy, tok)
    batch = collect_rollouts(backend, tok, ENV, [task_index], "train", dataclasses.replace(base, **changes))
    return batch, backend.stats


def policy_tokens(traj):
    return tuple(t for t, m in zip(traj.input_ids, traj.loss_mask) if m)


# %% [markdown]
# ## Exercise 1 · Temperature
#
# The lesson's group at `temperature` 0 (greedy), 1.0 and 1.5: how many of the 8 episodes differ, and the
# mean log-prob of the policy's tokens under the distribution they were sampled from.

# %%
distinct = {}
for temperature in (0.0, 1.0, 1.5):
    batch, _ = play(temperature=temperature)
    distinct[temperature] = len({policy_tokens(t) for t in batch.trajectories})
    mean_logp = float((batch.old_logprobs * batch.loss_mask).sum() / batch.loss_mask.sum())
    print(f"temperature {temperature:3.1f}: {distinct[temperature]} distinct episodes of {len(batch)}, "
          f"mean log-prob of a policy token {mean_logp:+.2f}, rewards {batch.rewards.tolist()}")
assert distinct[0.0] == 1

# %% [markdown]
# Greedy decoding plays the same episode 8 times: the same tokens, the same reward, so GRPO gives each an
# advantage of exactly 0 and the step learns nothing from the task, however good or bad the episode. A low
# temperature comes close to that; a high one spreads the group (lower log-probs, more varied and more
# broken text). GRPO needs a group that disagrees, which is why training samples at temperature 1. Note
# that `old_logprobs` are those of the distribution that was sampled (`logits / temperature`): only at
# temperature 1 (top-p 1) are they the policy's own, as the loss's ratio assumes.

# %% [markdown]
# ## Exercise 2 · Group size
#
# `group_size` 1, 4 and 16: the batch's shape, the generated tokens and the number of forward calls.

# %%
calls = {}
for group_size in (1, 4, 16):
    batch, stats = play(group_size=group_size)
    calls[group_size] = stats["forward_calls"]
    r = batch.rewards
    spread = float(r.std()) if len(r) > 1 else 0.0
    print(f"group_size {group_size:2d}: input_ids {tuple(batch.input_ids.shape)}, generated "
          f"{stats['generated_tokens']:5d} tokens in {stats['forward_calls']:3d} forward calls, "
          f"reward spread in the group {spread:.2f}")

# %% [markdown]
# The episodes of a group are generated together, one batch row each: the generated tokens grow with the
# group, the forward calls hardly do (they follow the longest turn, not the number of episodes). A group of
# 1 can never give an advantage other than 0 (nothing to compare with); a larger group is more likely to
# hold both a success and a failure on a task the policy sometimes solves, for little more time per step.

# %% [markdown]
# ## Exercise 3 · Turn limits
#
# `max_turns=1`, then the lesson's turn limit with `max_new_tokens_per_turn=8`, then the lesson's settings
# with a total budget `max_total_tokens` of 300: what ended each episode.

# %%
for changes in ({"max_turns": 1}, {"max_new_tokens_per_turn": 8}, {"max_total_tokens": 300}):
    batch, _ = play(**changes)
    ended = Counter(t.ended_by for t in batch.trajectories)
    turns = [t.turns for t in batch.trajectories]
    print(f"{str(changes):32s} ended by {dict(ended)}, turns {turns}, "
          f"longest {int(batch.lengths().max())} tokens")
    if changes.get("max_new_tokens_per_turn") == 8:
        assert "max_turn_tokens" in ended

# %% [markdown]
# Every episode ends for one recorded reason (`ended_by`): the environment (the customer said goodbye, a
# task was finished), the turn limit, the whole episode's token budget, or a turn that hit its token budget
# without the end-of-turn token. An episode cut by a limit is scored like any other (usually 0: the task is
# unfinished), and its tokens still go to the loss: limits bound the cost of a step, but set too tight
# they turn every group into equal zero rewards, with no signal left.
