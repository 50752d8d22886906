"""Playing episodes: :func:`collect_rollouts` runs a batch of environments against a generation
backend turn by turn and returns their trajectories, token in / token out (see the package docstring).
:class:`ChatDelta` renders an environment's reply as the tokens the chat template would put after an
assistant turn, so that the history is never re-tokenized."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backend import GenerationBackend, GenerationRequest, GenerationResult
from .trajectory import RolloutBatch, RolloutConfig, Trajectory

log = logging.getLogger(__name__)


def _template_text(tokenizer, messages, tools=None, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


class ChatDelta:
    """Tokenize one new non-assistant message the way the chat template would place it after an
    assistant turn, without re-rendering or re-tokenizing the history.

    The delta is found on a fixed reference conversation ``[system, user, assistant]``: the text the
    template writes after the assistant's end-of-turn token, then the new message, then the
    generation prompt. For Qwen2.5-style templates a tool result gives
    ``"\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        eot = tokenizer.eos_token
        if not eot:
            raise ValueError("the tokenizer has no eos_token (the assistant's end-of-turn token)")
        self.eot = eot
        self._base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                      {"role": "assistant", "content": "A"}]
        self._base_text = _template_text(tokenizer, self._base, self.tools)
        cut = self._base_text.rfind(eot)
        if cut < 0:
            raise ValueError(f"the chat template does not end an assistant turn with eos_token {eot!r}")
        self.after_eot = self._base_text[cut + len(eot):]

    def text(self, message: dict) -> str:
        full = _template_text(self.tokenizer, self._base + [message], self.tools, add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ValueError("the chat template re-renders earlier turns when a message is added, so a "
                             "trajectory cannot grow by deltas; use a prefix-stable template")
        return self.after_eot + full[len(self._base_text):]

    def ids(self, message: dict) -> list[int]:
        return self.tokenizer.encode(self.text(message), add_special_tokens=False)


# ----------------------------------------------------------------------------------------------------
# Generation backends
# ----------------------------------------------------------------------------------------------------



def episode_seed(seed: int, task_index: int, member: int, turn: int) -> int:
    """A 31-bit seed for one turn of one episode, independent of which other episodes are running."""
    return int(np.random.SeedSequence([seed, task_index, member, turn]).generate_state(1)[0] & 0x7FFFFFFF)


def assistant_message(text: str) -> dict:
    """The final-conversation form of an assistant turn: a structured tool call when ``text`` parses
    as one (the form SFT data and the chat template use), else the text itself."""
    from ..envs import parse_action

    action = parse_action(text)
    if action.kind == "tool":
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function",
                                "function": {"name": action.name, "arguments": action.arguments}}]}
    return {"role": "assistant", "content": text}


@dataclass
class _Episode:
    traj: Trajectory
    env: Any
    delta: ChatDelta
    env_tools: list[dict] | None = None
    done: bool = False


def _finish(ep: _Episode, ended_by: str) -> None:
    ep.traj.ended_by = ended_by
    if ended_by != "env":
        # cut by a limit, not ended by the task (Gymnasium's truncation): its reward stays what the
        # environment gave so far
        ep.traj.truncated = True
    ep.done = True
    ep.env.close()


def collect_rollouts(backend: GenerationBackend, tokenizer, env_id: str, task_indices: Sequence[int],
                     split: str = "train", cfg: RolloutConfig | None = None) -> RolloutBatch:
    """Play ``cfg.group_size`` episodes of each task in ``task_indices`` (all in one batch, turn by
    turn) and return them as a :class:`RolloutBatch` (rows grouped by task, ``group_ids`` = position of
    the task in ``task_indices``)."""
    import gymnasium as gym

    import sinkflex_core  # noqa: F401  (registers the environments)

    cfg = cfg or RolloutConfig()
    cfg.validate()
    if not len(task_indices):
        raise ValueError("task_indices is empty")
    stop_ids = backend.stop_token_ids
    episodes: list[_Episode] = []
    deltas: dict[int, ChatDelta] = {}
    pending_env = None  # an environment made but not yet in an episode (closed below if its set-up fails)
    try:
        for group, task_index in enumerate(task_indices):
            for member in range(cfg.group_size):
                env = gym.make(env_id, split=split, max_turns=cfg.max_turns, **cfg.env_kwargs)
                pending_env = env
                obs, info = env.reset(seed=cfg.seed, options={"task_index": int(task_index)})
                tools = info.get("tools") if cfg.include_tools else None
                system = cfg.system_prompt if cfg.system_prompt is not None else info.get("policy", "")
                messages = [{"role": "system", "content": system}, {"role": info.get("obs_role", "user"),
                                                                     "content": obs}]
                prompt = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                       add_generation_prompt=True, return_dict=False)
                prompt = list(prompt)
                if id(tools) not in deltas:
                    deltas[id(tools)] = ChatDelta(tokenizer, tools)
                traj = Trajectory(task_index=int(task_index), group=group, member=member, input_ids=prompt,
                                  loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt), messages=messages,
                                  tools=tools, prompt_len=len(prompt))
                ep = _Episode(traj=traj, env=env, delta=deltas[id(tools)], env_tools=info.get("tools"))
                episodes.append(ep)
                pending_env = None
                if len(prompt) >= cfg.max_total_tokens:
                    log.warning("the prompt of task %s has %d tokens, max_total_tokens=%d leaves none to "
                                "generate", task_index, len(prompt), cfg.max_total_tokens)
                    _finish(ep, "max_total_tokens")

        while True:
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            requests = []
            for ep in live:
                t = ep.traj
                budget = min(cfg.max_new_tokens_per_turn, cfg.max_total_tokens - len(t.input_ids))
                requests.append(GenerationRequest(
                    key=(t.group, t.member), prompt_ids=t.input_ids, max_new_tokens=budget,
                    seed=episode_seed(cfg.seed, t.task_index, t.member, t.turns), messages=t.messages,
                    tools=ep.env_tools))
            results = backend.generate(requests, temperature=cfg.temperature, top_p=cfg.top_p)
            if len(results) != len(requests):
                raise RuntimeError(f"the backend returned {len(results)} results for {len(requests)} requests")
            for ep, req, res in zip(live, requests, results):
                _advance(ep, req, res, tokenizer, stop_ids, cfg)
    finally:
        backend.release()
        if pending_env is not None:
            pending_env.close()
        for ep in episodes:
            if not ep.done:  # a finished episode's environment is closed already
                ep.env.close()
    return RolloutBatch.from_trajectories([ep.traj for ep in episodes], pad_token_id=tokenizer.pad_token_id or 0)


def _advance(ep: _Episode, req: GenerationRequest, res: GenerationResult, tokenizer, stop_ids,
             cfg: RolloutConfig) -> None:
    """Append one generated turn, step the environment, append its reply (or end the episode)."""
    t = ep.traj
    ids = list(res.token_ids)[:req.max_new_tokens]
    if len(res.logprobs) < len(ids):
        raise RuntimeError("the backend returned fewer log-probs than tokens")
    t.input_ids.extend(ids)
    t.loss_mask.extend([1] * len(ids))
    t.logprobs.extend(float(x) for x in res.logprobs[:len(ids)])
    t.turns += 1
    stopped = bool(ids) and ids[-1] in stop_ids
    text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
    t.messages.append(assistant_message(text))
    if not stopped:
        # The turn hit its token budget without its end token: its text is incomplete, so it is not
        # sent to the environment, and the episode ends here.
        hit_total = len(t.input_ids) >= cfg.max_total_tokens
        _finish(ep, "max_total_tokens" if hit_total else "max_turn_tokens")
        return
    obs, reward, terminated, truncated, info = ep.env.step(text)
    t.reward = float(reward)
    t.terminated, t.truncated = bool(terminated), bool(truncated)
    if terminated or truncated:
        t.env_info = {k: v for k, v in info.items() if k != "obs_role"}
        _finish(ep, "env" if terminated else "max_turns")
        return
    if t.turns >= cfg.max_turns:  # an environment that ignores max_turns
        _finish(ep, "max_turns")
        return
    message = {"role": info.get("obs_role", "user"), "content": obs}
    delta = ep.delta.ids(message)
    if len(t.input_ids) + len(delta) >= cfg.max_total_tokens:
        # The reply would leave no room for another turn: end on the assistant's end token.
        _finish(ep, "max_total_tokens")
        return
    t.messages.append(message)
    t.input_ids.extend(delta)
    t.loss_mask.extend([0] * len(delta))
    t.logprobs.extend([0.0] * len(delta))


# ----------------------------------------------------------------------------------------------------
# Checking token-in/token-out against the chat template
# ----------------------------------------------------------------------------------------------------

