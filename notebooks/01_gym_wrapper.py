# %% [markdown]
# # 01 · One Gymnasium interface for tool environments
#
# A store simulator with a scripted customer (state in SQLite), an airline's reservations desk, a text-to-SQL bank database, a shell over a folder of files and a Python module with a bug all look the same to an agent: text in, text out, a tool call in the Qwen2.5/Hermes format or a message to the user, and one reward at the end. The notebook plays a full retail episode with the policy-following oracle, shows how the reward is computed (database-state hash times required outputs), plays the airline behind the same API, reaches the same tools in process, over FastAPI and over MCP (and any MCP server), runs the executing environments in their jail, and measures the oracle against random and do-nothing agents, with pass^k.
#
# Needs: CPU only (Linux user namespaces for the jail; without them the executing environments run unjailed here, see the last section before the baselines). Smoke mode (`SINKFLEX_SMOKE=1`): about 20 seconds. Default: about 30 s on 2 idle cores (every test task, 4 trials per agent); it writes `data/01_env_baselines.csv` and `figures/01_env_baselines.png`.

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
# Importing `sinkflex_core` registers the Gymnasium ids of every environment in this notebook (ten in all);
# `ENV_IDS` holds the three met first. Each `reset` returns the user's first message
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
# said to the customer. Two rules keep an answer from being a guess, since most answers here are one
# of five labels: an order's status (or "not available") counts only in a message that names no
# other of those labels (a message listing all four statuses would otherwise answer about a fifth of the
# tasks), and an answer about an order counts only once the agent has looked that order up with
# `get_order_details` (`answers_looked_up` in the reward's details: saying "the order is delivered" to
# every customer would otherwise earn about one task in nine without a single tool call). Both are
# shortcuts that reinforcement learning finds. Otherwise any sequence of calls that reaches the same
# state passes.
# Below: the same task, but the agent refunds to the wrong payment method, and an information task
# where the answer is first never said, then said without looking the order up, then said after it.

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
print("answer guessed ->", backend.reward())
backend.call_tool("get_order_details", {"order_id": test_tasks[info_index]["requests"][0]["order_id"]})
print("order read     ->", backend.reward())

# %% [markdown]
# ## The same store over HTTP
#
# `sinkflex/RetailHTTP-v0` serves the tools with FastAPI (on uvicorn, in a thread of its own) bound to
# 127.0.0.1 on a port the OS picks; every tool call is a `POST /tools/<name>` round trip through an
# `httpx` client. The conversation is identical; only the
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

http_env.close()
# an episode ends after max_turns actions: room for every timed call, or most would only be refused
orders = list(world.data.orders)[:300]
for name, env_id in [("in process", "sinkflex/Retail-v0"), ("HTTP", "sinkflex/RetailHTTP-v0")]:
    timed = gym.make(env_id, split="test", max_turns=len(orders) + 1)
    timed.reset(options={"task_index": 0})
    t = time.perf_counter()
    for o in orders:
        obs, _, terminated, truncated, _ = timed.step(format_tool_call("get_order_details", {"order_id": o}))
        assert obs.startswith("{") and not (terminated or truncated), obs[:100]
    dt = (time.perf_counter() - t) / len(orders)
    print(f"{name:10s}: {1e6 * dt:.0f} us per tool call")
    timed.close()

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
# ## A second world behind the same API: the airline
#
# `sinkflex/Airline-v0` is a reservations desk: users with saved payment methods and membership tiers,
# flights on dates with seats and prices per cabin, reservations to book, cancel, change, with bags and
# passengers to update, and a policy with rules the agent has to apply (a basic-economy ticket cannot be
# moved to another flight; a cancellation is refunded only on some grounds). Nothing in the agent's loop
# changes: the same `reset`/`step`, the same tool-call format, the same reward (final database state and
# required outputs). Code written for the retail store (the oracle, `run_episode`, `evaluate_agent`,
# the rollout and training code later) runs on it unchanged. Use the airline when a policy has to
# transfer across domains, or to test one trained on retail on tools it never saw.

# %%
# NBVAL_CHECK_OUTPUT
from sinkflex_core.envs.airline_world import AirlineWorld

air_world = AirlineWorld.get(seed)
for key, value in air_world.stats().items():
    print(f"{key:14s} {value}")
air = gym.make("sinkflex/Airline-v0", split="test")
obs, info = air.reset(seed=seed, options={"task_index": 0})
names = [t["function"]["name"] for t in info["tools"]]
print(f"\nsinkflex/Airline-v0: {air.unwrapped.num_tasks} test tasks, {len(names)} tools: {', '.join(names)}\n")
air_messages, air_reward, air_info = run_episode(air, OracleAgent(), 0, seed=seed)
show(air_messages)
print("\nreward:", air_reward, "|", air_info["reward_info"])
n_air = 30 if smoke else air.unwrapped.num_tasks
air_rewards = [run_episode(air, OracleAgent(), i, seed=seed)[1] for i in range(n_air)]
print(f"oracle on the test split: mean reward {sum(air_rewards) / n_air:.2f}")
air.close()

# %% [markdown]
# Here the customer asks to move a basic-economy reservation; the policy forbids it, so the oracle looks
# the reservation up, says why it cannot, and changes nothing. The reward still checks both halves: the
# database must be untouched (`db_match`) and the reason, the cabin, must have been said.
#
# ## Four ways to reach the same tools
#
# The retail store and the airline each come in three forms, and any other tool server in a fourth:
#
# | form | ids | transport | when to use it |
# |---|---|---|---|
# | in process | `Retail-v0`, `Airline-v0` | a Python call | training and evaluation: the fastest, nothing to start |
# | FastAPI | `RetailHTTP-v0`, `AirlineHTTP-v0` | `POST /tools/<name>` on 127.0.0.1, schema at `/openapi.json` | to measure or test what an agent meets behind a web API: latency, 4xx answers, a server to run |
# | MCP | `RetailMCP-v0`, `AirlineMCP-v0` | Model Context Protocol (streamable HTTP) | to train against the protocol agent frameworks speak, with known rewards |
# | any MCP server | `MCP-v0` | stdio (a command) or a URL | your own tools: the server, a task file and a verifier are all you write |
#
# The first three share the world, the tasks and the reward, so an episode is the same conversation in
# each: only the transport differs. `MCP-v0` lists its tools from the server (the schemas the server
# declares, not ours), runs each task's setup calls and scores the episode with the task file's verifier;
# without arguments it starts the shipped notes server (FastMCP over SQLite) with its five test tasks.

# %%
# NBVAL_CHECK_OUTPUT
import httpx

from sinkflex_core.envs import DoNothingAgent
from sinkflex_core.envs.examples.notes_mcp.expert import NotesExpert

reference, ref_reward, _ = run_episode(env, OracleAgent(), task_index, seed=seed)
for env_id in ("sinkflex/RetailHTTP-v0", "sinkflex/RetailMCP-v0"):
    served = gym.make(env_id, split="test")
    served_messages, served_reward, _ = run_episode(served, OracleAgent(), task_index, seed=seed)
    print(f"{env_id:22s} same transcript as in process: {served_messages == reference} | reward: {served_reward}")
    if env_id.endswith("HTTP-v0"):
        spec = httpx.get(served.unwrapped.backend.url + "/openapi.json").json()
        paths = [p for p in spec["paths"] if p.startswith("/tools/")]
        print(f"  /openapi.json: {spec['info']['title']!r}, {len(paths)} tool paths, e.g. {paths[0]}")
    served.close()

notes = gym.make("sinkflex/MCP-v0", split="test")
obs, info = notes.reset(options={"task_index": 0})
print(f"\nsinkflex/MCP-v0 (the notes example): {notes.unwrapped.num_tasks} test tasks")
print("  tools from the server:", ", ".join(t["function"]["name"] for t in info["tools"]))
print("  first task:", obs)
for name, make in (("expert", NotesExpert), ("do-nothing", DoNothingAgent)):
    rewards = [run_episode(notes, make(), i)[1] for i in range(notes.unwrapped.num_tasks)]
    print(f"  {name:10s} rewards: {rewards}")
notes.close()

# %% [markdown]
# To put your own tools behind the interface, point `MCP-v0` at your server and a task file:
# `gym.make("sinkflex/MCP-v0", command=["python", "-m", "my_server"], tasks="my_tasks.json")` (or
# `url="http://127.0.0.1:PORT/mcp"`); each task gives the instruction, optional setup calls made at reset,
# and a verifier (a Python function or a command) that grades the episode. The format is described in
# `sinkflex_core/envs/mcp_env.py`, the shipped example is `sinkflex_core/envs/examples/notes_mcp/`, and
# what every form guarantees whatever the agent writes is in `docs/limits.md`.
#
# ## Environments that execute: a shell and code repair
#
# `sinkflex/Bash-v0` (NL2Bash-style requests over a seeded folder of files) and
# `sinkflex/CodeRepair-v0` (fix a planted bug; hidden tests decide) run what the agent writes, for real.
# The verifier reads the result, not the transcript: the final file tree, the submitted answer, or the
# hidden cases run in a fresh sandbox. A judge adds a second reward channel:
# `reward = (1 - judge_weight) * verifier + judge_weight * judge(messages, tools)`, by default a
# rule-based format judge at weight 0.1 (any `judge(messages, tools) -> float` fits, `HFJudge` asks a
# local model). Use them when the skill to learn is acting on a system rather than following a policy.

# %%
# NBVAL_CHECK_OUTPUT
from sinkflex_core.envs.bash_env import BashExpert
from sinkflex_core.envs.code_repair import CodeRepairExpert
from sinkflex_core.envs.sandbox import jail_available

jailed, why = jail_available()
# without user namespaces the same episodes run unjailed (same outputs, none of the jail's guarantees)
executing = {env_id: gym.make(env_id, split="test", allow_unjailed=not jailed)
             for env_id in ("sinkflex/Bash-v0", "sinkflex/CodeRepair-v0")}
for (env_id, e), expert in zip(executing.items(), (BashExpert, CodeRepairExpert)):
    e_messages, e_reward, e_info = run_episode(e, expert(), 0, seed=seed)
    print(f"{env_id}: {e.unwrapped.num_tasks} test tasks")
    show(e_messages, width=110)
    print("reward:", e_reward, "|", {k: v for k, v in e_info["reward_info"].items() if k != "cases"})
    _, idle_reward, idle_info = run_episode(e, DoNothingAgent(), 0, seed=seed)
    ri = idle_info["reward_info"]
    print(f"do-nothing: verifier {ri['verifier']:.3f}, judge {ri['judge']:.1f} -> reward {idle_reward:.3f}\n")

# %% [markdown]
# Doing nothing on the code-repair task still passes the hidden cases of the functions that had no bug
# (a third of them here), and its one plain message is well formed, so it gets 0.9 x 0.333 + 0.1 x 1.0 = 0.4:
# a baseline to beat, not zero.
#
# Every command runs in a jail (`sinkflex_core/envs/sandbox.py`, details in `docs/sandbox.md`): new user,
# mount, PID and network namespaces, a read-only root with only `/usr` and the episode's folder at
# `/sandbox`, no network, and limits on wall and CPU time, processes, memory, file size and output. Below,
# a few commands an agent (or a reward-hacking policy) might try; the timings are this machine's.

# %%
print("jail:", why if jailed else f"not available here ({why}); these commands ran unjailed")
bash_env = executing["sinkflex/Bash-v0"]
for command in ("cat /etc/shadow; ls /home; echo $HOME", "ls /",
                "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 22))' 2>&1 | tail -1",
                "head -c 20000000 /dev/zero > big", "sleep 30"):
    bash_env.reset(options={"task_index": 0})
    t = time.perf_counter()
    obs = bash_env.step(format_tool_call("run", {"command": command}))[0]
    print(f"$ {command}\n  {obs.strip().replace(chr(10), chr(10) + '  ')}\n  ({time.perf_counter() - t:.2f} s)")
for e in executing.values():
    e.close()

# %% [markdown]
# ## Baselines: oracle, random agent, do-nothing agent
#
# Each agent plays every test task (`trials` times for the random agent, with different seeds); pass^k
# is the chance that k independent tries at a task all succeed: the mean over tasks of C(c, k) / C(n, k).

# %%
import pandas as pd

from sinkflex_core.envs import RandomAgent, evaluate_agent, pass_hat_k

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

# %% [markdown]
# ## Exercises
#
# Change one thing, run the cells again, and look for what each exercise names.
#
# 1. **A malformed tool call.** In the `parse_action` cell, add a call to a misspelled tool, one without its
#    `order_id`, and one whose JSON is cut off; then send each to `env.step(...)` after
#    `env.reset(options={"task_index": 0})`. Look at the observation, the reward and `terminated`: why is it
#    better for training that nothing raises and the episode goes on?
# 2. **Another world, another form.** Make the store with
#    `gym.make("sinkflex/Retail-v0", split="test", world_seed=1)` and let the oracle play a few test tasks;
#    then play airline task 0 with `sinkflex/AirlineHTTP-v0` and compare its transcript with `air_messages`.
#    What does the oracle's reward on a world it never saw say about what it relies on?
# 3. **The reward of a wrong answer.** In the reward cell, answer the information task with a wrong status
#    (`backend.respond("It is pending.")`), then with every status in one message. Which half of the reward
#    fails, and why does the second answer score 0 as well?
#
# Solutions: [`solutions/01_gym_wrapper.py`](solutions/01_gym_wrapper.py), one cell per exercise that runs and prints what to look for (JupyterLab with jupytext opens it as a notebook; or `jupytext --to ipynb notebooks/solutions/01_gym_wrapper.py`).
