"""A scripted agent behind the generation interface (:class:`AgentBackend`): expert data for SFT and
baselines, played through the same rollout code as a policy."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from .backend import GenerationRequest, GenerationResult


class AgentBackend:
    """A scripted agent (e.g. :class:`sinkflex_core.envs.OracleAgent`) behind the generation interface.

    Each turn the agent reads the latest message of the conversation and writes its action; the text
    is tokenized the canonical way and closed with the end-of-turn token, with log-prob 0. It yields
    expert trajectories in exactly the token layout of policy rollouts, and a reference for
    :func:`check_template_consistency` (an agent whose text is canonical must match the template)."""

    def __init__(self, tokenizer, agent_factory=None):
        if agent_factory is None:
            from ..envs import OracleAgent

            agent_factory = OracleAgent
        self.tokenizer = tokenizer
        self.agent_factory = agent_factory
        self.stop_token_ids = {tokenizer.eos_token_id}
        self.release()

    def release(self) -> None:
        self._agents: dict[Hashable, tuple[Any, int]] = {}

    def generate(self, requests: Sequence[GenerationRequest], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[GenerationResult]:
        results = []
        for r in requests:
            if r.messages is None:
                raise ValueError("AgentBackend needs the conversation in each request (messages)")
            if r.key not in self._agents:
                agent = self.agent_factory()
                agent.reset(r.messages[-1]["content"], {"tools": r.tools or []})
            else:
                agent, seen = self._agents[r.key]
                if len(r.messages) > seen:
                    agent.observe(r.messages[-1]["content"])
            self._agents[r.key] = (agent, len(r.messages))
            eos = self.tokenizer.eos_token_id
            ids = self.tokenizer.encode(agent.act(), add_special_tokens=False) + [eos]
            # As a language model would: stop at the first end token, or be cut by the budget.
            ids = ids[: min(ids.index(eos) + 1, r.max_new_tokens)]
            results.append(GenerationResult(ids, [0.0] * len(ids), ids[-1] == eos))
        return results

