# %% [markdown]
# # 04 · Multi-turn rollouts, token in / token out
#
# A tiny policy plays a group of 8 episodes of one retail task, turn by turn: its tokens are appended as generated (loss mask 1, with their sampling log-probs), each tool result or customer reply is rendered by the chat template as a delta, tokenized once and appended (loss mask 0), and the KV cache of earlier turns is reused. We check that the ids assembled this way equal the chat template applied to the final conversation, colour the tokens by origin, and show the batch of plain tensors that goes to the GRPO loss.
#
# Needs: CPU only. Default settings: 2 to 3 minutes on 2 idle cores (most of it a short supervised warm-up of the tiny policy on the oracle's conversations); smoke mode: under a minute.

# %% tags=["parameters"]
smoke = False
seed = 0
task_index = 0
group_size = 8
sft_steps = 120
max_turns = 6

# %%
import warnings

from sinkflex_core.notebooks import resolve_smoke

# tqdm (imported by transformers) warns that Jupyter widgets are missing; bars are not used here.
warnings.filterwarnings("ignore", message="IProgress not found")

smoke = resolve_smoke(smoke)
max_new_tokens_per_turn = 96
if smoke:
    sft_steps = 4
    max_turns = 2
    max_new_tokens_per_turn = 40

# %% [markdown]
# ## The tokenizer and its chat template
#
# `get_tokenizer()` trains a byte-level BPE (3,072 ids) on the retail world's own text in a few seconds and caches it in `build/`. Its chat template follows Qwen2.5's layout: a system turn (with the tool list when tools are given), tool calls as `<tool_call>` JSON, tool results as a user turn of `<tool_response>` blocks. The delta that a tool result adds after an assistant turn:

# %%
# NBVAL_CHECK_OUTPUT
import torch

from sinkflex_core.models import build_model, count_parameters, get_tokenizer, tiny_qwen2_config
from sinkflex_core.rollout import ChatDelta

tok = get_tokenizer()
delta = ChatDelta(tok)
print(len(tok), "ids;", "end of turn:", tok.eos_token, tok.eos_token_id)
print(repr(delta.text({"role": "tool", "content": '{"status": "pending"}'})))
print(tok.convert_ids_to_tokens(delta.ids({"role": "tool", "content": '{"status": "pending"}'})))

# %% [markdown]
# ## Expert trajectories from the oracle, in the same token layout
#
# `AgentBackend` puts a scripted agent behind the generation interface: the oracle's text is tokenized the canonical way, so its trajectories must equal the chat template's tokens exactly, and they solve their tasks unless the 2,048-token budget of `expert_cfg` cuts one short (two of the 64 here, hence the mean reward of 0.97). They are also the data of the warm-up below. The policy sees a compact prompt (a one-line system prompt, no tool list): the tiny model learns the tools from these conversations.

# %%
from sinkflex_core.rollout import AgentBackend, RolloutConfig, check_template_consistency, collect_rollouts

ENV = "sinkflex/Retail-v0"
SYSTEM = "You are the store's assistant."
n_expert = 4 if smoke else 64
expert_cfg = RolloutConfig(group_size=1, max_turns=30, max_total_tokens=2048, max_new_tokens_per_turn=256,
                           system_prompt=SYSTEM, include_tools=False, seed=seed)
expert = collect_rollouts(AgentBackend(tok), tok, ENV, list(range(100, 100 + n_expert)), "train", expert_cfg)
checks = [check_template_consistency(t, tok) for t in expert.trajectories]
print(f"{len(expert)} expert trajectories, mean reward {expert.rewards.mean():.2f}, "
      f"token-exact vs the template: {sum(c.equal for c in checks)}/{len(checks)}")
print("lengths:", expert.lengths().tolist()[:8], "...")

# %% [markdown]
# ## A tiny policy, briefly warmed up
#
# A 4.7M-parameter Qwen2-architecture model with random weights writes noise that never ends its turn. A short supervised warm-up on the expert tokens (loss on the loss-masked tokens only) is enough for it to end its turns and to imitate the shape of the conversation.

# %%
import numpy as np
import torch.nn.functional as F

policy = build_model(tiny_qwen2_config(len(tok), tokenizer=tok), seed=seed)
print(f"{count_parameters(policy) / 1e6:.1f}M parameters")
opt = torch.optim.AdamW(policy.parameters(), lr=2e-3, weight_decay=0.0)
rng = np.random.default_rng(seed)
policy.train()
for step in range(sft_steps):
    rows = torch.as_tensor(rng.choice(len(expert), size=2 if smoke else 4, replace=False))
    n = min(int(expert.lengths()[rows].max()), 512 if smoke else 1024)  # the first turns matter most
    ids, att, lm = expert.input_ids[rows, :n], expert.attention_mask[rows, :n], expert.loss_mask[rows, :n]
    logits = policy(ids, attention_mask=att).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    loss = (nll * lm[:, 1:].reshape(-1)).sum() / lm[:, 1:].sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()
    if step % 25 == 0 or step == sft_steps - 1:
        print(f"step {step:4d}  loss on policy tokens {loss.item():.3f}")
policy.eval();

# %% [markdown]
# ## A group of 8 rollouts of one task
#
# `collect_rollouts` plays all 8 episodes in one batch with the HF backend, which keeps each episode's KV cache between turns and prefills only the new tokens. `ended_by` says what ended each episode: the environment (`env`), the turn limit, the total token budget or the per-turn budget.

# %%
import pandas as pd

from sinkflex_core.rollout import HFBackend

cfg = RolloutConfig(group_size=group_size, max_turns=max_turns, max_total_tokens=1536,
                    max_new_tokens_per_turn=max_new_tokens_per_turn,
                    temperature=1.0, top_p=1.0, system_prompt=SYSTEM, include_tools=False, seed=seed)
backend = HFBackend(policy, tok)
batch = collect_rollouts(backend, tok, ENV, [task_index], "train", cfg)
table = pd.DataFrame(batch.stats)[["member", "turns", "ended_by", "reward", "length", "policy_tokens"]]
table["template check"] = [str(check_template_consistency(t, tok)).split(" at ")[0] for t in batch.trajectories]
print("prefilled", backend.stats["prefill_tokens"], "tokens and generated", backend.stats["generated_tokens"],
      "over", backend.stats["forward_calls"], "forward calls")
table

# %% [markdown]
# Where the check reports a difference, the policy wrote something the template would render or split otherwise (for example a tool call whose JSON is spaced differently, or a token sequence that the tokenizer would merge): training on the token-in/token-out ids trains on what was actually sampled, which re-tokenizing the conversation would not.
#
# ## The tokens, coloured by origin
#
# Green: policy tokens (loss mask 1; hover for the sampling log-prob). Blue: what the environment said (customer replies, tool results) and the template's turn markers. The prompt is left out.

# %%
from IPython.display import HTML, display

from sinkflex_core.rollout import legend_html, trajectory_html

print("task:", batch.trajectories[0].messages[1]["content"])
display(HTML(legend_html()))
for traj, s in zip(batch.trajectories, batch.stats):
    display(HTML(f"<b>episode {s['member']}</b>: reward {s['reward']}, {s['turns']} turns, ended by "
                 f"{s['ended_by']}" + trajectory_html(traj, tok, max_tokens=400)))

# %% [markdown]
# ## The batch that goes to the loss
#
# Plain tensors, one row per episode (right-padded), all aligned with `input_ids`: `old_logprobs[:, t]` is the sampling log-prob of `input_ids[:, t]` where `loss_mask` is 1. Group ids tie the 8 episodes of the task together for GRPO's group-relative advantage.

# %%
for name in ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "position_ids", "group_ids", "rewards"):
    t = getattr(batch, name)
    print(f"{name:15s} {str(tuple(t.shape)):12s} {str(t.dtype):14s}")
r = batch.rewards
adv = (r - r.mean()) / (r.std() + 1e-6) if len(r) > 1 else r * 0
print("rewards   ", r.tolist())
print("advantages", [round(a, 2) for a in adv.tolist()], "(reward minus group mean, over group std)")
row = 0
n = int(batch.lengths()[row])
first = int(batch.loss_mask[row].nonzero()[0])
print(f"row {row}: {n} tokens; first policy token at {first};",
      "loss_mask around it:", batch.loss_mask[row, first - 3:first + 5].tolist())
print("old_logprobs there:", [round(x, 2) for x in batch.old_logprobs[row, first - 3:first + 5].tolist()])

# %% [markdown]
# Packed layout: several trajectories per row of a fixed width, position ids restarting at 0 for each, and a document id per token for the packed-document attention mask. `packed.attention_mask_4d()` builds that mask for a transformers model; the 2-D `attention_mask` alone would let a row's later trajectories attend to the ones before them.

# %%
packed = batch.pack(max_tokens=int(batch.lengths().max()) * 2)
print("packed rows:", tuple(packed.input_ids.shape), "from", len(batch), "trajectories")
print("documents per row:", [sorted(set(r.tolist()) - {-1}) for r in packed.doc_ids])
print("padding tokens: padded", int((batch.attention_mask == 0).sum()), "vs packed", int((packed.attention_mask == 0).sum()))

# %% [markdown]
# ## Exercises
#
# Change one thing, run the cells again, and look for what each exercise names.
#
# 1. **Temperature.** Play the group with `temperature=0` (greedy), then `1.5`, in `cfg`. How many of the 8
#    episodes differ, what happens to `old_logprobs`, and what advantages does GRPO give a group of identical
#    episodes?
# 2. **Group size.** Set `group_size` to 1, then 16, and look at the batch's shape and at the backend's
#    `generated_tokens` and `forward_calls`. Why does a bigger group cost less than proportionally more, and
#    what advantage can a group of one give?
# 3. **Turn limits.** One at a time, set `max_turns=1`, `max_new_tokens_per_turn=8` and
#    `max_total_tokens=300`, and read `ended_by` in the table. What reward does an episode cut by a limit get,
#    and what is left of the learning signal when the limits are too tight?
#
# Solutions: [`solutions/04_rollouts.py`](solutions/04_rollouts.py), one cell per exercise that runs and prints what to look for (JupyterLab with jupytext opens it as a notebook; or `jupytext --to ipynb notebooks/solutions/04_rollouts.py`).
