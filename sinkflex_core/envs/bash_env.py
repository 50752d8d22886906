"""``sinkflex/Bash-v0``: NL2Bash-style tasks run for real in a jailed shell.

Each episode gets a folder filled from the task's seed (:mod:`.bash_tasks`); the agent runs commands
with ``run`` (each one in the jail of :mod:`.sandbox`, working directory ``/sandbox``) and ends with
``submit``. Reward (the verifier): for a question, 1.0 when the submitted answer equals the expected
one (trimmed, a leading ``./`` and a trailing ``/`` dropped, numbers compared as numbers); for a
change, 1.0 when the final tree (regular files by content and owner-execute bit, symlinks by target,
nothing else allowed) equals the expected tree; for an archive request, when the archive holds
exactly the folder's files and nothing else changed. Else 0.0.

The folder is capped (``MAX_TREE_BYTES``, ``MAX_TREE_ENTRIES``): past either, the episode ends.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Generator

from .base import ScriptedExpert, ToolResult, format_tool_call
from .bash_tasks import bash_tasks, check_archive, normalise_answer, read_tree, tree_state, write_tree
from .retail_tools import ToolError, check_arguments
from .sandbox import Limits, Sandbox, tree_usage

MAX_TREE_BYTES = 64 << 20
MAX_TREE_ENTRIES = 5_000
MAX_COMMAND_CHARS = 4_000

POLICY = """You operate a Linux shell to do what the user asks with the files in /sandbox.
Call run with one bash command per turn (working directory /sandbox; GNU coreutils, find, grep, sed, awk,
tar, gzip and python3 are available; there is no network). Each command is limited in time, memory and
output. When the task is done, call submit: with the answer when the user asked a question (just the
value, e.g. a number or a path relative to /sandbox), or with an empty answer after changing files.
Change only what the user asked for."""

TOOL_SCHEMAS = [
    {"type": "function", "function": {
        "name": "run", "description": "Run one bash command in /sandbox; returns its exit code and output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "End the task, with the answer when the task is a question.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": []}}},
]
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}


class BashBackend:
    """Backend of ``sinkflex/Bash-v0`` (see the module docstring). ``limits`` bounds each command;
    ``allow_unjailed`` accepts running without namespaces where they do not work (see :class:`Sandbox`)."""

    def __init__(self, limits: Limits | None = None, allow_unjailed: bool = False, jail: bool | None = None):
        self.box = Sandbox(limits, jail=jail, allow_unjailed=allow_unjailed)
        self.split, self.index = "train", 0
        self.task: dict | None = None
        self.answer: str | None = None
        self.over_quota = False
        self.commands = 0

    def num_tasks(self, split: str) -> int:
        return len(bash_tasks(split))

    def tools(self) -> list[dict]:
        return copy.deepcopy(TOOL_SCHEMAS)

    def policy(self) -> str:
        return POLICY

    def reset(self, split: str, task_index: int) -> tuple[str, dict]:
        self.split, self.index = split, task_index
        self.task = bash_tasks(split)[task_index]
        self.answer, self.over_quota, self.commands = None, False, 0
        self.box.clear()
        write_tree(self.task["tree"], self.box.dir)
        self.box.handover()
        public = {k: v for k, v in self.task.items() if k != "tree"}
        public["files"] = sorted(self.task["tree"])
        return self.task["question"], public

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        try:
            check_arguments(name, arguments, _SCHEMAS)
        except ToolError as err:
            return ToolResult(f"Error: {err}")
        if name == "submit":
            answer = arguments.get("answer", "")
            self.answer = answer if isinstance(answer, str) else str(answer)
            return ToolResult("Submitted.", done=True)
        command = arguments["command"]
        if not command.strip():
            return ToolResult("Error: the command is empty")
        if len(command) > MAX_COMMAND_CHARS:
            return ToolResult(f"Error: the command is {len(command)} characters long (limit {MAX_COMMAND_CHARS})")
        if "\x00" in command:
            return ToolResult("Error: the command contains a NUL character")
        self.commands += 1
        result = self.box.run(command)
        size, entries = tree_usage(self.box.dir, MAX_TREE_ENTRIES + 1)
        if size > MAX_TREE_BYTES or entries > MAX_TREE_ENTRIES:
            self.over_quota = True
            return ToolResult(result.observation() + f"\n[the sandbox is over its quota ({MAX_TREE_BYTES >> 20} MiB, "
                              f"{MAX_TREE_ENTRIES} entries); the episode ends]", done=True)
        return ToolResult(result.observation())

    def respond(self, text: str) -> ToolResult:
        return ToolResult("Please use the run tool for commands and submit when you are done.")

    def reward(self) -> tuple[float, dict]:
        task = self.task
        if task is None:
            return 0.0, {"error": "no task"}
        details = {"kind": task["kind"], "commands": self.commands, "over_quota": self.over_quota}
        if task["kind"] == "question":
            ok = self.answer is not None and normalise_answer(self.answer) == normalise_answer(task["answer"])
            details.update(answer=self.answer, expected=task["answer"], match=ok)
            return float(ok), details
        final = read_tree(self.box.dir, MAX_TREE_ENTRIES)
        if task["kind"] == "archive":
            name = task["expected"]["archive"]
            ok, why = check_archive(self.box.dir, name, task["expected"]["folder"], task["tree"])
            rest = {k: v for k, v in final.items() if k != name} == tree_state(task["tree"])
            details.update(archive=why, rest_unchanged=rest, match=ok and rest)
            return float(ok and rest), details
        ok = final == task["expected"]
        details.update(match=ok, missing=sorted(set(task["expected"]) - set(final))[:10],
                       unexpected=sorted(set(final) - set(task["expected"]))[:10])
        return float(ok), details

    def close(self) -> None:
        self.box.close()


# ---- the expert --------------------------------------------------------------------------------------

def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


_AWK_SUM = "awk -F, 'NR==1{for(i=1;i<=NF;i++) if($i==\"amount\") k=i; next} {s+=$k} END{print s+0}' "
_RECIPES: list[tuple[str, object]] = [
    (r"How many files with the extension \.(\S+) are there in the sandbox, in all folders\?",
     lambda m: f"find . -type f -name {_q('*.' + m[1])} | wc -l"),
    (r"Which file contains the word (\S+)\? Answer with its path relative to the sandbox\.",
     lambda m: f"grep -rlF -- {_q(m[1])} . | sed 's|^\\./||'"),
    (r"How many lines of (\S+) contain (\S+)\?", lambda m: f"grep -cF -- {_q(m[2])} {_q(m[1])}"),
    (r"Which file under (\S+)/ is the largest\? Answer with its path relative to the sandbox\.",
     lambda m: f"find {_q(m[1])} -type f -printf '%s %p\\n' | sort -n | tail -n 1 | cut -d' ' -f2-"),
    (r"What is the sum of the amount column of (\S+)\?", lambda m: _AWK_SUM + _q(m[1])),
    (r"How many lines does (\S+) have\?", lambda m: f"wc -l < {_q(m[1])}"),
    (r"How many distinct values does the city column of (\S+) have\?",
     lambda m: f"tail -n +2 {_q(m[1])} | cut -d, -f2 | sort -u | wc -l"),
    (r"Rename every \.(\S+) file directly in (\S+)/ so that its extension is \.(\S+) instead\.",
     lambda m: f"for f in {_q(m[2])}/*.{m[1]}; do mv -- \"$f\" \"${{f%.{m[1]}}}.{m[3]}\"; done"),
    (r"Extract the archive (\S+) into a new folder named (\S+)\.",
     lambda m: f"mkdir -p {_q(m[2])} && tar -xzf {_q(m[1])} -C {_q(m[2])}"),
    (r"Create a gzip-compressed tar archive (\S+) in the sandbox holding the folder (\S+) ",
     lambda m: f"tar -czf {_q(m[1])} {_q(m[2])}"),
    (r"Delete every file whose name ends in \.(\S+), in all folders\.",
     lambda m: f"find . -type f -name {_q('*.' + m[1])} -delete"),
    (r"Move every file directly in (\S+)/ whose name contains (\S+) into a new folder (\S+)\.",
     lambda m: f"mkdir -p {_q(m[3])} && find {_q(m[1])} -maxdepth 1 -type f -name {_q('*' + m[2] + '*')} "
               f"-exec mv -t {_q(m[3])} {{}} +"),
    (r"In every \.(\S+) file, in all folders, replace each occurrence of (\S+) with (\S+)\.",
     lambda m: f"find . -type f -name {_q('*.' + m[1])} -exec sed -i 's/{m[2]}/{m[3]}/g' {{}} +"),
    (r"Write the distinct lines of (\S+), sorted, into a file (\S+) in the sandbox\.",
     lambda m: f"LC_ALL=C sort -u {_q(m[1])} > {_q(m[2])}"),
    (r"Make every \.sh file directly in scripts/ executable\.", lambda m: "chmod u+x scripts/*.sh"),
    (r"Write the first (\d+) lines of (\S+) into a file (\S+) in the sandbox\.",
     lambda m: f"head -n {m[1]} {_q(m[2])} > {_q(m[3])}"),
    (r"Delete every empty file, in all folders\.", lambda m: "find . -type f -empty -delete"),
]
_RECIPES_RE = [(re.compile(p), f) for p, f in _RECIPES]


def command_for(question: str) -> tuple[str, bool] | None:
    """The expert's command for a request written from one of the templates, and whether the
    request is a question (the command's output is then the answer)."""
    for i, (pattern, make) in enumerate(_RECIPES_RE):
        m = pattern.match(question)
        if m:
            return make(m), i < 7
    return None


class BashExpert(ScriptedExpert):
    """Turns the request into one command, runs it, submits (the output, for a question)."""

    fallback = format_tool_call("submit", {"answer": ""})

    def _script(self, question: str) -> Generator[str, str, None]:
        recipe = command_for(question)
        if recipe is None:
            yield format_tool_call("submit", {"answer": ""})
            return
        command, is_question = recipe
        out = yield format_tool_call("run", {"command": command})
        lines = out.split("\n", 1)
        answer = lines[1].strip() if is_question and len(lines) > 1 else ""
        yield format_tool_call("submit", {"answer": answer})
