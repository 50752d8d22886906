"""The verifier of the notes tasks: ``check(task, episode)`` as a Python callable, and the same check as
a command (``python -m sinkflex_core.envs.examples.notes_mcp.checks``: the episode as JSON on stdin,
the reward on stdout's last line).

``episode`` holds ``answer`` (the agent's final message), ``tool_calls`` and ``state``: the output of
the task file's ``state_call`` after the episode (here every note, as JSON)."""

from __future__ import annotations

import json
import re
import sys


def _answer_is(expected: str, answer: str) -> bool:
    """The expected text as a whole token of the answer (``3`` is not in ``13``)."""
    return re.search(r"(?<![\w-])" + re.escape(expected.lower()) + r"(?![\w-])", answer.lower()) is not None


def check(task: dict, episode: dict) -> tuple[float, dict]:
    expect = task["expect"]
    notes = json.loads(episode["state"])
    setup = [c["arguments"] for c in task.get("setup", [])]
    details = {}
    if "answer" in expect:
        details["answer"] = _answer_is(expect["answer"], episode["answer"])
    if expect.get("unchanged"):
        details["unchanged"] = [(n["title"], n["body"], n["tags"]) for n in notes] == [
            (a["title"], a["body"], a.get("tags", [])) for a in setup]
    if "note" in expect:
        want = expect["note"]
        details["note"] = any(n["title"] == want["title"] and n["body"] == want["body"]
                              and sorted(n["tags"]) == sorted(want["tags"]) for n in notes)
    if "titles" in expect:
        details["titles"] = sorted(n["title"] for n in notes) == sorted(expect["titles"])
    if "count" in expect:
        details["count"] = len(notes) == expect["count"]
    return float(all(details.values())), details


def main() -> None:
    payload = json.load(sys.stdin)
    reward, _ = check(payload["task"], payload["episode"])
    print(reward)


if __name__ == "__main__":
    main()
