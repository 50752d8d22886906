# %% [markdown]
# # 01 · One Gymnasium interface for tool environments
#
# A store simulator with a scripted customer (state in SQLite), the same store served by an HTTP API on 127.0.0.1, and a text-to-SQL bank database all look the same to an agent: text in, text out, a tool call in the Qwen2.5/Hermes format or a message to the user, and one reward at the end. The notebook plays a full retail episode with the policy-following oracle, shows how the reward is computed (database-state hash times required outputs), and measures the oracle against random and do-nothing agents, with pass^k.
#
# Needs: CPU only. Smoke mode (`SINKFLEX_SMOKE=1`): under 30 s. Default: about 2 minutes on a 2-core CPU (every test task, 4 trials per agent); it writes `data/01_env_baselines.csv` and `figures/01_env_baselines.png`.

# %% tags=["parameters"]
smoke = False
seed = 0
trials = 4

# %%
from sinkflex_core.notebooks import resolve_smoke

smoke = resolve_smoke(smoke)
print("smoke mode:", smoke)

# %% [markdown]
# ## Three kinds of environment, one interface
#
# Importing `sinkflex_core` registers three Gymnasium ids. Each `reset` returns the user's first message
# and an `info` dict with the task, the tools (OpenAI function schemas) and the policy (the agent's
# system prompt); each `step` takes the text a chat model wrote.

# %%
# NBVAL_CHECK_OUTPUT
import gymnasium as gym

import sinkflex_core  # registers the environments
from sinkflex_core.envs import ENV_IDS

for env_id in ENV_IDS:
    env = gym.make(env_id, split="test")
    obs, info = env.reset(seed=seed, options={"task_index": 0})
    names = [t["function"]["name"] for t in info["tools"]]
    print(f"{env_id}: {env.unwrapped.num_tasks} test tasks, {len(names)} tools")
    print(f"  first observation: {obs}")
    print(f"  tools: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
    env.close()

# %% [markdown]
# The agent's actions are parsed by one function, `parse_action`: a `<tool_call>` block, a bare JSON
# object with `name` and `arguments`, or plain text for the user. Anything else becomes an
# `Error: ...` observation, never an exception.

# %%
# NBVAL_CHECK_OUTPUT
from sinkflex_core.envs import parse_action

for text in ['<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W1234567"}}\n</tool_call>',
             '{"name": "think", "arguments": {"thought": "check the status first"}}',
             "Could you give me your email, please?",
             '<tool_call>{"name": "cancel_pending_order", "arguments": {"order_id": </tool_call>']:
    a = parse_action(text)
    print(f"{a.kind:8s} {a.name or '-':22s} {a.arguments or a.error or a.content!r}")

# %% [markdown]
# ## The retail world
#
# Generated from a seed at the public benchmark's scale and status mix, written once into an
# in-memory SQLite database; each episode gets its own copy through SQLite's backup API.

# %%
# NBVAL_CHECK_OUTPUT
from sinkflex_core.envs import RetailWorld, get_tasks

world = RetailWorld.get(seed)
stats = world.stats()
for key, value in stats.items():
    print(f"{key:20s} {value}")
from collections import Counter

for split in ("train", "test"):
    tasks = get_tasks(seed, split)
    kinds = Counter(r["kind"] for t in tasks for r in t["requests"])
    multi = sum(len(t["requests"]) > 1 for t in tasks)
    print(f"{split}: {len(tasks)} tasks ({multi} with two requests); requests: {dict(sorted(kinds.items()))}")

# %% [markdown]
# ## A full retail episode, played by the oracle
#
# The oracle follows the policy from the conversation alone: it asks for identity, looks the user and
# the order up, lists what it will do with the ids and asks for a "yes", makes one write, reports.
# The scripted customer answers from its persona and ends with `###STOP###`. Here is an exchange task.

# %%
# NBVAL_CHECK_OUTPUT
from sinkflex_core.envs import OracleAgent, run_episode

env = gym.make("sinkflex/Retail-v0", split="test")
test_tasks = get_tasks(seed, "test")
task_index = next(i for i, t in enumerate(test_tasks) if t["requests"][0]["kind"] == "exchange"
                  and len(world.data.users[t["user_id"]]["payment_method_ids"]) > 1)
messages, reward, last_info = run_episode(env, OracleAgent(), task_index, seed=seed)


def show(messages, width=150):
    for m in messages[1:]:
        if m.get("tool_calls"):
            call = m["tool_calls"][0]["function"]
            text = f"<tool_call> {call['name']}({call['arguments']})"
        else:
            text = m["content"]
        text = text if len(text) <= width else text[:width] + " ..."
        print(f"{m['role']:>9s} | {text}")


show(messages)
print("\nreward:", reward, "|", last_info["reward_info"])

# %% [markdown]
# ## How the reward is computed
#
# At the end of an episode the environment hashes a canonical dump of every table. It replays the
# task's ground-truth actions on a fresh copy of the initial database and hashes that too. The reward
# is 1 when the two hashes are equal *and* every required output (for example an order's total) was
# said to the customer. An order's status (or "not available") counts only in a message that names no
# other of those labels: a message listing all four statuses would otherwise answer about a fifth of the
# tasks without a single tool call, a shortcut that reinforcement learning finds. Reads never matter, and
# any sequence of calls that reaches the same state passes.
# Below: the same task, but the agent refunds to the wrong payment method, and an information task
# where the answer is never said.

# %%
# NBVAL_CHECK_OUTPUT
from sinkflex_core.envs import expected_hash, format_tool_call, state_hash

task = test_tasks[task_index]
print("ground truth:", task["actions"])
print("required outputs:", task["outputs"])
backend = env.unwrapped.backend
print("initial hash :", world.initial_hash[:16])
print("expected hash:", expected_hash(world, "test", task_index)[:16])

env.reset(options={"task_index": task_index})
call = task["actions"][0]
own_methods = world.data.users[task["user_id"]]["payment_method_ids"]
other_method = next(p for p in own_methods if p != call["arguments"]["payment_method_id"])
wrong = {**call["arguments"], "payment_method_id": other_method}
print("wrong call   :", env.step(format_tool_call(call["name"], wrong))[0])
print("final hash   :", state_hash(backend.conn)[:16], "->", backend.reward())

info_index = next(i for i, t in enumerate(test_tasks) if t["outputs"] and not t["actions"])
env.reset(options={"task_index": info_index})
print("\ninformation task:", test_tasks[info_index]["requests"][0]["text"], "| required:", test_tasks[info_index]["outputs"])
print("silent agent   ->", backend.reward())
backend.respond(f"It is {test_tasks[info_index]['outputs'][0]}.")
print("answer given   ->", backend.reward())

# %% [markdown]
# ## The same store over HTTP
#
# `sinkflex/RetailHTTP-v0` starts a `ThreadingHTTPServer` bound to 127.0.0.1 on a port the OS picks;
# every tool call is a `POST /tools/<name>` round trip. The conversation is identical; only the
# transport differs. Malformed requests get 4xx answers.

# %%
from sinkflex_core.envs.http_server import post_raw

http_env = gym.make("sinkflex/RetailHTTP-v0", split="test")
http_messages, http_reward, _ = run_episode(http_env, OracleAgent(), task_index, seed=seed)
print("same transcript as in process:", http_messages == messages, "| reward:", http_reward)
url = http_env.unwrapped.backend.url
for body, headers in [(b'{"arguments": {"order_id": "#W0000000"}}', {"Content-Type": "application/json"}),
                      (b"{not json", {"Content-Type": "application/json"}),
                      (b'{"arguments": {"order_id": 7}}', {"Content-Type": "application/json"}),
                      (b"{}", {"Content-Type": "text/plain"})]:
    print(post_raw(url + "/tools/get_order_details", body, headers))

import time

orders = list(world.data.orders)[:300]
for name, e in [("in process", env), ("HTTP", http_env)]:
    e.reset(options={"task_index": 0})
    t = time.perf_counter()
    for o in orders:
        e.step(format_tool_call("get_order_details", {"order_id": o}))
    dt = (time.perf_counter() - t) / len(orders)
    print(f"{name:10s}: {1e6 * dt:.0f} us per tool call")
http_env.close()

# %% [markdown]
# ## A text-to-SQL episode
#
# `sinkflex/BankSQL-v0`: the agent runs read-only queries (an SQLite authorizer lets only SELECT
# through) and answers with `submit_answer`; the reward compares the submitted query's result set with
# the ground truth's, as a multiset of rows.

# %%
# NBVAL_CHECK_OUTPUT
bank = gym.make("sinkflex/BankSQL-v0", split="test")
bank_messages, bank_reward, _ = run_episode(bank, OracleAgent(), 5, seed=seed)
show(bank_messages)
print("reward:", bank_reward)
bank.reset(options={"task_index": 5})
print(bank.step(format_tool_call("run_sql", {"query": "DELETE FROM loans"}))[0])

# %% [markdown]
# ## Baselines: oracle, random agent, do-nothing agent
#
# Each agent plays every test task (`trials` times for the random agent, with different seeds); pass^k
# is the chance that k independent tries at a task all succeed: the mean over tasks of C(c, k) / C(n, k).

# %%
import pandas as pd

from sinkflex_core.envs import DoNothingAgent, RandomAgent, evaluate_agent, pass_hat_k

n_tasks = 30 if smoke else None
n_trials = 2 if smoke else trials
agents = {"oracle": lambda t: OracleAgent(), "random": lambda t: RandomAgent(seed + t),
          "do-nothing": lambda t: DoNothingAgent()}
rows = []
for env_id in ("sinkflex/Retail-v0", "sinkflex/BankSQL-v0"):
    e = gym.make(env_id, split="test")
    indices = range(n_tasks or e.unwrapped.num_tasks)
    for name, make in agents.items():
        results = evaluate_agent(e, make, indices, trials=n_trials, seed=seed)
        row = {"env": env_id, "agent": name, "tasks": len(indices), "trials": n_trials,
               "mean_reward": sum(map(sum, results)) / (len(indices) * n_trials)}
        for k in range(1, n_trials + 1):
            row[f"pass^{k}"] = pass_hat_k(results, k)
        rows.append(row)
    e.close()
table = pd.DataFrame(rows)
print(table.round(3).to_string(index=False))

# %%
import matplotlib.pyplot as plt

from sinkflex_core.paths import data_dir, figures_dir

fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
for ax, env_id in zip(axes, ("sinkflex/Retail-v0", "sinkflex/BankSQL-v0")):
    sub = table[table.env == env_id]
    ks = [c for c in table.columns if c.startswith("pass^")]
    styles = {"oracle": ("o", "-", 8), "random": ("x", "--", 10), "do-nothing": ("s", ":", 5)}
    for _, r in sub.iterrows():
        marker, line, size = styles[r["agent"]]
        ax.plot(range(1, len(ks) + 1), [r[c] for c in ks], marker=marker, linestyle=line, markersize=size,
                label=f"{r['agent']} (mean reward {r['mean_reward']:.2f})")
    ax.set_title(f"{env_id} (test split)")
    ax.set_xlabel("k")
    ax.set_xticks(range(1, len(ks) + 1))
axes[0].set_ylabel("pass^k")
axes[0].set_ylim(-0.05, 1.05)
for ax in axes:
    ax.legend(loc="center right", fontsize=8)
fig.tight_layout()
if not smoke:
    from sinkflex_core.provenance import provenance

    for key, value in provenance(seed=seed).items():
        table[key] = value
    table.to_csv(data_dir() / "01_env_baselines.csv", index=False)
    fig.savefig(figures_dir() / "01_env_baselines.png", dpi=120)
    print("wrote data/01_env_baselines.csv and figures/01_env_baselines.png")
plt.show()

# %% [markdown]
# The oracle solves every test task (reward 1.0, so pass^k stays at 1 for all k), while the random and
# do-nothing agents stay at 0: a task can only be passed by reaching the right database state and
# saying the required answers, which neither baseline does by chance. The oracle's conversations are the
# supervised fine-tuning data for the small policies trained later (`expert_conversation`).
