"""An agent that solves the notes tasks: it replays the task's reference tool calls, then answers.

It reads the task from ``info["task"]`` (``ToolEnv.reset`` gives it), like the oracle of the other
worlds; it is the expert of SFT data and the check that every shipped task can be solved."""

from __future__ import annotations

from ...base import format_tool_call


class NotesExpert:
    def reset(self, observation: str, info: dict) -> None:
        task = info["task"]
        self._plan = [format_tool_call(c["name"], c["arguments"]) for c in task["solution"]] + [task["answer"]]

    def observe(self, observation: str) -> None:
        pass

    def act(self, observation: str | None = None, role: str = "user") -> str:
        return self._plan.pop(0) if len(self._plan) > 1 else self._plan[0]
