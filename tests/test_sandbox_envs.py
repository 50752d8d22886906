"""``sinkflex/Bash-v0`` and ``sinkflex/CodeRepair-v0`` behind the common interface: tasks, rewards,
experts, baselines, gymnasium's checker and the async vector env."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import SANDBOX_ENV_IDS, format_tool_call
from sinkflex_core.envs.bash_env import BashExpert, command_for
from sinkflex_core.envs.bash_tasks import CHANGES, QUESTIONS, bash_tasks, make_task, normalise_answer
from sinkflex_core.envs.code_repair import CodeRepairExpert
from sinkflex_core.envs.oracle import DoNothingAgent, RandomAgent, run_episode
from sinkflex_core.envs.sandbox import jail_available

JAIL_OK, JAIL_WHY = jail_available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"no namespace jail here: {JAIL_WHY}")
EXPERTS = {"sinkflex/Bash-v0": BashExpert, "sinkflex/CodeRepair-v0": CodeRepairExpert}


def run(command: str) -> str:
    return format_tool_call("run", {"command": command})


@pytest.fixture(scope="module")
def bash_env():
    env = gym.make("sinkflex/Bash-v0", split="test", judge=None)
    yield env
    env.close()


@pytest.mark.parametrize("env_id", SANDBOX_ENV_IDS)
def test_check_env(env_id):
    env = gym.make(env_id, split="train")
    check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("env_id", SANDBOX_ENV_IDS)
def test_reset_contract(env_id):
    env = gym.make(env_id, split="test", max_turns=3)
    try:
        assert env.unwrapped.num_tasks >= 100
        obs, info = env.reset(seed=0, options={"task_index": 1})
        assert isinstance(obs, str) and obs and info["obs_role"] == "user" and len(info["policy"]) > 200
        assert all(t["function"]["parameters"]["type"] == "object" for t in info["tools"])
        for _ in range(3):
            obs, reward, terminated, truncated, step_info = env.step("hello")
        assert truncated and 0.0 <= reward <= 1.0 and "verifier" in step_info["reward_info"]
        with pytest.raises(ValueError, match="task_index"):
            env.reset(options={"task_index": 10_000})
        with pytest.raises(ValueError, match="split"):
            gym.make(env_id, split="dev")
        with pytest.raises(ValueError, match="judge_weight"):
            gym.make(env_id, judge_weight=1.5)
    finally:
        env.close()


def test_tasks_are_deterministic_and_cover_every_family():
    a, b = make_task(123), make_task(123)
    assert a == b and a["tree"] and make_task(124)["tree"] != a["tree"]
    train, test = bash_tasks("train"), bash_tasks("test")
    assert len(train) >= 400 and len(test) >= 100
    assert {t["family"] for t in train} == {f.__name__.strip("_") for f in QUESTIONS + CHANGES}
    assert not {t["seed"] for t in train} & {t["seed"] for t in test}
    assert all(command_for(t["question"]) is not None for t in train + test)


def test_answers_are_compared_after_normalising():
    assert normalise_answer(" ./docs/a.txt/ \n") == "docs/a.txt"
    assert normalise_answer("42.0") == normalise_answer("42") == "42"
    assert normalise_answer("'x'") == "x" and normalise_answer("4 2") != "42"


def _index(family: str) -> int:
    return next(i for i, t in enumerate(bash_tasks("test")) if t["family"] == family)


def test_question_reward_needs_the_right_answer(bash_env):
    i = _index("count_ext")
    task = bash_tasks("test")[i]
    bash_env.reset(options={"task_index": i})
    *_, info = bash_env.step(format_tool_call("submit", {"answer": str(int(task["answer"]) + 1)}))
    assert info["reward_info"]["verifier"] == 0.0
    bash_env.reset(options={"task_index": i})
    obs, reward, terminated, _, info = bash_env.step(format_tool_call("submit", {"answer": f" {task['answer']}\n"}))
    assert terminated and reward == 1.0


def test_change_reward_reads_the_real_file_tree(bash_env):
    i = _index("delete_ext")
    task = bash_tasks("test")[i]
    command, _ = command_for(task["question"])
    bash_env.reset(options={"task_index": i})
    bash_env.step(run(command + " && touch stray.txt"))  # right change plus one file too many
    *_, reward, _, _, info = bash_env.step(format_tool_call("submit", {}))
    assert reward == 0.0 and info["reward_info"]["unexpected"] == ["stray.txt"]
    bash_env.reset(options={"task_index": i})
    bash_env.step(run(command))
    *_, reward, _, _, info = bash_env.step(format_tool_call("submit", {}))
    assert reward == 1.0, info


def test_archive_reward_opens_the_archive(bash_env):
    i = _index("archive")
    task = bash_tasks("test")[i]
    name, folder = task["expected"]["archive"], task["expected"]["folder"]
    for command, want in ((f"tar -czf {name} {folder}", 1.0), (f"tar -cf {name} {folder}", 0.0),
                          (f"tar -czf {name} {folder} && rm -r {folder}", 0.0), (f"ln -s /etc/passwd {name}", 0.0)):
        bash_env.reset(options={"task_index": i})
        bash_env.step(run(command))
        *_, reward, _, _, info = bash_env.step(format_tool_call("submit", {}))
        assert reward == want, (command, info["reward_info"])


def test_over_quota_ends_the_episode(bash_env):
    bash_env.reset(options={"task_index": 0})
    obs, reward, terminated, _, info = bash_env.step(run("mkdir m && cd m && touch $(seq 6000)"))
    assert terminated and "over its quota" in obs and info["reward_info"]["over_quota"]


def test_commands_run_in_a_fresh_folder_each_episode(bash_env):
    bash_env.reset(options={"task_index": 0})
    bash_env.step(run("echo left > leftover.txt"))
    bash_env.reset(options={"task_index": 0})
    obs, *_ = bash_env.step(run("ls leftover.txt"))
    assert "No such file" in obs


@pytest.mark.parametrize("env_id", SANDBOX_ENV_IDS)
def test_expert_solves_a_sample_of_test_tasks(env_id):
    env = gym.make(env_id, split="test")
    n = env.unwrapped.num_tasks
    rewards = [run_episode(env, EXPERTS[env_id](), i)[1] for i in range(0, n, 9)]
    env.close()
    assert min(rewards) == 1.0, rewards


@pytest.mark.slow
@pytest.mark.parametrize("env_id", SANDBOX_ENV_IDS)
def test_expert_solves_every_test_task(env_id):
    env = gym.make(env_id, split="test", judge=None)
    rewards = [run_episode(env, EXPERTS[env_id](), i)[1] for i in range(env.unwrapped.num_tasks)]
    env.close()
    assert sum(rewards) == len(rewards), [i for i, r in enumerate(rewards) if r < 1]


def test_baselines_stay_low_on_bash(bash_env):
    for agent in (RandomAgent(0), DoNothingAgent()):
        rewards = [run_episode(bash_env, agent, i)[1] for i in range(0, 100, 10)]
        assert sum(rewards) / len(rewards) <= 0.1


@pytest.mark.parametrize("env_id", SANDBOX_ENV_IDS)
def test_make_vec_async(env_id):
    envs = gym.make_vec(env_id, num_envs=3, vectorization_mode="async", split="test")
    try:
        obs, info = envs.reset(seed=0)
        assert isinstance(obs, tuple) and len(obs) == 3 and all(isinstance(o, str) and o for o in obs)
        tool = "run" if env_id.endswith("Bash-v0") else "run_tests"
        args = {"command": "ls | wc -l"} if tool == "run" else {}
        obs, rewards, terminated, truncated, info = envs.step((format_tool_call(tool, args),) * 3)
        assert all(o.startswith("exit code: ") for o in obs), obs
        assert isinstance(rewards, np.ndarray) and rewards.shape == (3,)
    finally:
        envs.close()
