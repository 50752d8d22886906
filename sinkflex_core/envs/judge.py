"""Reward channels: the environment's verifier plus an optional judge of the transcript.

A *judge* is any callable ``judge(messages, tools) -> float`` in [0, 1], where ``messages`` is the
episode as chat messages (``{"role": "user" | "assistant" | "tool", "content": str}``, the raw
assistant text included) and ``tools`` the environment's OpenAI tool schemas. :class:`JudgedToolEnv`
combines it with the backend's verifier at the end of an episode::

    reward = (1 - judge_weight) * verifier + judge_weight * judge(messages, tools)

``info["reward_info"]`` keeps both parts (``verifier``, ``judge``, ``judge_weight``). The default judge
is :class:`FormatJudge` (rules, no model) with ``DEFAULT_JUDGE_WEIGHT`` = 0.1, so correctness
dominates and a correct episode in a clean format scores 1.0; ``judge=None`` leaves the verifier
alone. :class:`HFJudge` asks a local Hugging Face causal LM a yes/no question about the transcript.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .base import ToolBackend, ToolEnv, parse_action

DEFAULT_JUDGE_WEIGHT = 0.1
Judge = Callable[[list[dict], list[dict]], float]


class FormatJudge:
    """Share of assistant turns in a clean format.

    A tool call scores 1 when it is one call to a listed tool with every required argument and no
    unknown one, in a closed ``<tool_call>`` block with nothing but whitespace around it (0.5 with
    other text around it, as bare JSON or unclosed; 0 for an unknown tool or bad arguments); a
    malformed call scores 0; a plain message
    scores 1 when it is non-empty, at most ``max_message_chars`` long and free of tool-call markup.
    No assistant turn: 0.
    """

    def __init__(self, max_message_chars: int = 2_000):
        self.max_message_chars = max_message_chars

    def turn_score(self, text: str, tools: dict[str, dict]) -> float:
        action = parse_action(text)
        if action.kind == "invalid":
            return 0.0
        if action.kind == "message":
            body = text.strip()
            clean = body and len(body) <= self.max_message_chars and "tool_call" not in body
            return 1.0 if clean else 0.0
        schema = tools.get(action.name)
        if schema is None:
            return 0.0
        props, required = schema.get("properties", {}), schema.get("required", [])
        if any(k not in props for k in action.arguments) or any(k not in action.arguments for k in required):
            return 0.0
        if "<tool_call>" not in text or "</tool_call>" not in text:  # bare JSON or an unclosed block
            return 0.5
        outside = text.split("<tool_call>", 1)[0] + text.rsplit("</tool_call>", 1)[1]
        return 0.5 if outside.strip() else 1.0

    def __call__(self, messages: list[dict], tools: list[dict]) -> float:
        by_name = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        return sum(self.turn_score(t, by_name) for t in turns) / len(turns) if turns else 0.0


DEFAULT_QUESTION = ("Is every assistant turn above a single well-formed tool call or a short, clear message? "
                    "Answer yes or no.\nAnswer:")


class HFJudge:
    """A local causal LM as judge: the score is P(yes) / (P(yes) + P(no)) for the continuations
    ``yes`` and ``no`` (each may be several tokens; their log-probabilities are summed) after the
    transcript and ``question``.

    ``model`` is a ``transformers`` causal LM, ``tokenizer`` its tokenizer. The transcript is kept to
    its last ``max_tokens`` tokens. Runs under ``torch.no_grad`` on the model's device.
    """

    def __init__(self, model, tokenizer, question: str = DEFAULT_QUESTION, yes: str = " yes", no: str = " no",
                 max_tokens: int = 2_048):
        self.model, self.tokenizer, self.question = model, tokenizer, question
        self.yes_ids = tokenizer.encode(yes, add_special_tokens=False)
        self.no_ids = tokenizer.encode(no, add_special_tokens=False)
        if not self.yes_ids or not self.no_ids or self.yes_ids == self.no_ids:
            raise ValueError(f"the yes/no answers {yes!r}/{no!r} must tokenize to different, non-empty ids")
        self.question_ids = tokenizer.encode(question, add_special_tokens=False)
        room = max_tokens - len(self.question_ids) - max(len(self.yes_ids), len(self.no_ids))
        if room < 16:
            raise ValueError(f"max_tokens={max_tokens} leaves {room} tokens of transcript beside the question "
                             f"({len(self.question_ids)} tokens) and the answer; allow at least 16")
        self.max_tokens = max_tokens
        self._room = room

    @staticmethod
    def render(messages: list[dict]) -> str:
        return "".join(f"[{m['role']}] {m['content']}\n" for m in messages)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The transcript's last tokens (as many as fit ``max_tokens``) followed by the question."""
        body = self.tokenizer.encode(self.render(messages), add_special_tokens=False)
        return body[-self._room:] + self.question_ids

    def continuation_logprob(self, prompt: list[int], continuation: list[int]) -> float:
        """log P(continuation | prompt) under the model (sum over its tokens)."""
        import torch

        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt + continuation], device=device)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        return float(logp.gather(1, torch.tensor(continuation, device=device)[:, None]).sum())

    def __call__(self, messages: list[dict], tools: list[dict]) -> float:
        prompt = self.prompt_ids(messages)
        yes, no = self.continuation_logprob(prompt, self.yes_ids), self.continuation_logprob(prompt, self.no_ids)
        top = max(yes, no)
        return math.exp(yes - top) / (math.exp(yes - top) + math.exp(no - top))


class JudgedToolEnv(ToolEnv):
    """A :class:`ToolEnv` whose final reward mixes the verifier with a judge (module docstring).

    ``judge``: ``"format"`` (default, :class:`FormatJudge`), ``None`` (verifier only) or a callable.
    A judge that returns anything but a finite number in [0, 1] raises ``ValueError``.
    """

    def __init__(self, backend: ToolBackend, split: str = "train", max_turns: int = 30,
                 render_mode: str | None = None, judge: Judge | str | None = "format",
                 judge_weight: float = DEFAULT_JUDGE_WEIGHT):
        if judge == "format":
            judge = FormatJudge()
        elif judge is not None and not callable(judge):
            raise ValueError(f"judge must be 'format', None or a callable, got {judge!r}")
        if isinstance(judge_weight, bool) or not isinstance(judge_weight, (int, float)) \
                or not 0.0 <= judge_weight <= 1.0:
            raise ValueError(f"judge_weight must be a number in [0, 1], got {judge_weight!r}")
        super().__init__(backend, split=split, max_turns=max_turns, render_mode=render_mode)
        self.judge = judge
        self.judge_weight = float(judge_weight) if judge is not None else 0.0

    def messages(self) -> list[dict]:
        """The episode so far as chat messages (the raw assistant text, the observations as shown)."""
        return [{"role": role, "content": text} for role, text in self._transcript]

    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        if "reward_info" in info and self.judge is not None:
            score = self.judge(self.messages(), self.backend.tools())
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
                    or not 0.0 <= score <= 1.0:
                raise ValueError(f"the judge returned {score!r}; it must return a number in [0, 1]")
            verifier = reward
            reward = (1.0 - self.judge_weight) * verifier + self.judge_weight * float(score)
            info["reward_info"] = {**info["reward_info"], "verifier": verifier, "judge": float(score),
                                   "judge_weight": self.judge_weight}
        elif "reward_info" in info:
            info["reward_info"] = {**info["reward_info"], "verifier": reward, "judge": None, "judge_weight": 0.0}
        return obs, float(reward), terminated, truncated, info
