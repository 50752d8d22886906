"""Simulated customers: the scripted, deterministic one, and the interface an LLM-backed one fills.

The scripted customer plays a task's persona: it opens with its first request, gives its identity
when asked, says "yes" only to a confirmation that names everything its goal needs (order id, new
item ids, payment method id, reason or address), moves to its next request once the current one has
been carried out or answered, and ends with ``###STOP###``.
"""

from __future__ import annotations

from typing import Protocol

from .retail_tasks import answer_given, identity_text, mentions

STOP = "###STOP###"
CONFIRM_MARK = "(yes/no)"
MAX_STRIKES = 4


class Customer(Protocol):
    """What the retail environment needs from a customer (scripted or LLM-backed)."""

    def opening(self) -> str: ...

    def reply(self, agent_text: str) -> tuple[str, bool]:
        """The customer's answer to the agent's message and whether the customer has left."""


class ScriptedCustomer:
    """Deterministic customer for one task (see the module docstring for its rules)."""

    def __init__(self, task: dict):
        self.task = task
        self.requests = task["requests"]
        self.index = 0
        self.confirmed = False
        self.strikes = 0

    def opening(self) -> str:
        return "Hi! " + self.requests[0]["text"]

    def _advance(self) -> tuple[str, bool]:
        self.index += 1
        self.confirmed = False
        self.strikes = 0
        if self.index >= len(self.requests):
            return f"Thanks, that is all. {STOP}", True
        return "Thanks. Also: " + self.requests[self.index]["text"], False

    def reply(self, agent_text: str) -> tuple[str, bool]:
        if self.index >= len(self.requests):
            return STOP, True
        req = self.requests[self.index]
        low = agent_text.lower()
        if CONFIRM_MARK in low:
            if req["confirm_keys"] and not self.confirmed and all(self._confirms(k, agent_text)
                                                                   for k in req["confirm_keys"]):
                self.confirmed = True
                return "yes", False
            return self._strike("No, that is not what I want. " + req["text"])
        if self.confirmed:
            return self._advance()
        if req["answer_keys"] and all(self._answers(k, agent_text) for k in req["answer_keys"]):
            return self._advance()
        identity = self._identity(low)
        if identity is not None:
            return self._strike(identity)
        return self._strike(req["text"])

    # ---- what differs between worlds ----------------------------------------------------------
    def _confirms(self, key: str, agent_text: str) -> bool:
        """Whether a confirmation request names ``key``."""
        return mentions(key, agent_text)

    def _answers(self, key: str, agent_text: str) -> bool:
        """Whether the agent's message gives the answer ``key``."""
        return answer_given(key, agent_text)

    def _identity(self, low: str) -> str | None:
        """The customer's identity if the (lower-cased) message asks for it, else None."""
        if "email" in low or "zip" in low:
            return identity_text(self.task["persona"], self.task["identify_by"])
        return None

    def _strike(self, text: str) -> tuple[str, bool]:
        # a customer who is not getting anywhere leaves, so a stuck agent cannot loop forever
        self.strikes += 1
        if self.strikes > MAX_STRIKES:
            return f"I give up. {STOP}", True
        return text, False
