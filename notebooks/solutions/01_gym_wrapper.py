# %% [markdown]
# # Solutions · 01 One Gymnasium interface for tool environments
#
# Run the cells in order; each prints what the exercise asks you to look for. Try the exercise in the
# lesson first. Takes about a minute on a laptop CPU (seconds in smoke mode).

# %%
import gymnasium as gym

import sinkflex_core  # registers the environments
from sinkflex_core.envs import OracleAgent, get_tasks, parse_action, run_episode
from sinkflex_core.notebooks import resolve_smoke

smoke = resolve_smoke(False)
seed = 0

# %% [markdown]
# ## Exercise 1 · A malformed tool call
#
# Four broken actions: through `parse_action`, then as a step of the retail environment. What comes back,
# and is the episode over?

# %%
broken = {
    "misspelled tool": '<tool_call>{"name": "get_order_detail", "arguments": {"order_id": "#W1234567"}}</tool_call>',
    "missing argument": '<tool_call>{"name": "get_order_details", "arguments": {}}</tool_call>',
    "cut-off JSON": '<tool_call>{"name": "get_order_details", "arguments": {"order_id": </tool_call>',
    "wrong argument type": '<tool_call>{"name": "get_order_details", "arguments": {"order_id": 7}}</tool_call>',
}
env = gym.make("sinkflex/Retail-v0", split="test")
env.reset(options={"task_index": 0})
for name, text in broken.items():
    a = parse_action(text)
    obs, reward, terminated, truncated, _ = env.step(text)
    print(f"{name:19s} parsed as {a.kind:9s} -> observation {obs!r}, reward {reward}, "
          f"terminated {terminated}, truncated {truncated}")
    assert obs.startswith("Error") and not terminated
messages, reward, _ = run_episode(env, OracleAgent(), 0, seed=seed)
print("the same environment, reset, then played by the oracle: reward", reward)

# %% [markdown]
# A broken action never raises and never ends the episode: the agent gets an `Error: ...` observation
# that says what was wrong, the turn is spent, and the next turn can repair the call. For training this
# matters twice: a policy's early, malformed calls cost turns rather than crashing a rollout, and the
# error text is a signal the policy can learn to read.

# %% [markdown]
# ## Exercise 2 · Another world, another form
#
# `gym.make("sinkflex/Retail-v0", split="test", world_seed=1)`: a store generated from another seed,
# played by the oracle. Then the airline over HTTP (`sinkflex/AirlineHTTP-v0`) against the in-process
# airline on its first task.

# %%
for world_seed in (0, 1):
    other = gym.make("sinkflex/Retail-v0", split="test", world_seed=world_seed)
    n = 5 if smoke else 20
    rewards = [run_episode(other, OracleAgent(), i, seed=seed)[1] for i in range(n)]
    first = get_tasks(world_seed, "test")[0]["requests"][0]["text"]
    print(f"world_seed {world_seed}: first test task {first!r} | oracle on {n} test tasks: "
          f"mean reward {sum(rewards) / n:.2f}")
    assert sum(rewards) == n
    other.close()
in_process = run_episode(gym.make("sinkflex/Airline-v0", split="test"), OracleAgent(), 0, seed=seed)
served = gym.make("sinkflex/AirlineHTTP-v0", split="test")
over_http = run_episode(served, OracleAgent(), 0, seed=seed)
served.close()
print("airline task 0, in process vs over HTTP: same transcript", in_process[0] == over_http[0],
      "| rewards", in_process[1], over_http[1])
assert in_process[0] == over_http[0]

# %% [markdown]
# Another seed gives another store (other users, orders, numbers) with its own tasks and ground truths,
# and the oracle still solves them: it follows the policy from the conversation, it does not remember a
# world. A policy that only memorised world 0's ids would fail here, which makes another seed a cheap test
# of generalisation. The transport (in process, HTTP, MCP) changes nothing an agent sees.

# %% [markdown]
# ## Exercise 3 · The reward of a wrong answer
#
# The lesson's information task (the customer asks for an order's status): look the order up, then answer
# with the wrong status, with every status at once, and with the right one; last, the right one without
# looking the order up.

# %%
test_tasks = get_tasks(seed, "test")
index = next(i for i, t in enumerate(test_tasks) if t["requests"][0]["kind"] == "status")
right = test_tasks[index]["outputs"][0]
wrong = next(s for s in ("pending", "delivered", "processed", "cancelled") if s != right)
print("task:", test_tasks[index]["requests"][0]["text"], "| required:", test_tasks[index]["outputs"])
answers = {"wrong status": f"It is {wrong}.",
           "every status": "It is pending, delivered, processed or cancelled.",
           "right status": f"It is {right}.", "right, unread": f"It is {right}."}
backend = env.unwrapped.backend
for name, text in answers.items():
    env.reset(options={"task_index": index})
    if name != "right, unread":
        backend.call_tool("get_order_details", {"order_id": test_tasks[index]["requests"][0]["order_id"]})
    backend.respond(text)
    reward, why = backend.reward()
    print(f"{name:13s} {text!r:53s} -> reward {reward}, database unchanged {why['db_match']}, "
          f"answer found {why['outputs_found']}, order read {why['answers_looked_up']}")
    assert reward == (1.0 if name == "right status" else 0.0)
env.close()

# %% [markdown]
# A wrong answer scores 0, like saying nothing: the database is untouched either way, so the hash half
# passes and the required output decides. Listing every status also scores 0, since a status counts only in
# a message that names no other status: without that rule the reward would pay a policy for an answer that
# needs no tool call at all, and reinforcement learning finds such shortcuts quickly. The right status
# unread scores 0 too, for the same reason: an agent that says the commonest status to every customer
# ("delivered") would be right on 28 of the 59 status questions of the training and test tasks without
# reading a single order, and on the refusals that name the same word.
