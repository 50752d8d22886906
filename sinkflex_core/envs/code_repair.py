"""``sinkflex/CodeRepair-v0``: fix a planted bug in a small Python module; hidden tests decide.

Each episode's folder holds ``<module>.py`` (one function with a bug, one or two correct ones) and
``test_<module>.py`` (a few visible cases). Tools read, write and patch files (flat names only, no
links followed, sizes capped; done by this process with ``O_NOFOLLOW``), list them, run the visible
tests (``python3 test_<module>.py`` in the jail of :mod:`.sandbox`, with its limits) and submit.

Reward (the verifier): the share of hidden cases passing. The module as the agent left it is copied
into a second, fresh sandbox with a runner that imports it (two seconds of alarm) and calls each
case's function (one second each) and prints each output as JSON; outputs are compared here, outside
the jail, with the expected values, which never enter it. A module that prints forged results gains nothing: it would have to
know the expected outputs, i.e. compute them.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import stat
from collections.abc import Generator
from pathlib import Path

from .base import ScriptedExpert, ToolResult, format_tool_call
from .code_repair_tasks import bug_catalogue, code_repair_tasks, normalise_output, visible_test_file
from .retail_tools import ToolError
from .sandbox import Limits, Sandbox

MAX_FILE_CHARS = 20_000
MAX_FILES = 50
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_MARK = "@@case "

POLICY = """You repair Python code. The user names a module with a bug and its test file. Use list_files and
read_file to look, patch_file (replace one exact snippet) or write_file (the whole file) to change code, and
run_tests to run the visible tests. Hidden tests of every function in the module decide the reward, so fix
the bug itself rather than the tests. Call submit when you are done. Each turn is one tool call."""

_STR = {"type": "string"}
TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "list_files", "description": "List the files of the project.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {"name": "read_file", "description": "Show a file's text.",
                                      "parameters": {"type": "object", "properties": {"path": _STR},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Replace a file's whole text "
                                      "(or create the file).", "parameters": {
                                          "type": "object", "properties": {"path": _STR, "content": _STR},
                                          "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "patch_file", "description": "Replace the one occurrence of "
                                      "`old` in a file with `new`.", "parameters": {
                                          "type": "object", "properties": {"path": _STR, "old": _STR, "new": _STR},
                                          "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the visible tests.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {"name": "submit", "description": "End the task; hidden tests run.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
]
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}

# The grader's runner: the expected outputs are not in it; it only computes and prints.
_RUNNER = r'''import io, json, os, signal, sys
sys.path.insert(0, "/sandbox")
out = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr = io.StringIO()
CASES = json.loads(sys.argv[1])
def alarm(*_):
    raise TimeoutError("case took too long")
signal.signal(signal.SIGALRM, alarm)
signal.alarm(2)
try:
    import {module} as m
    signal.alarm(0)
except BaseException as err:
    out.write("@@import " + json.dumps(type(err).__name__) + "\n"); out.flush(); raise SystemExit(0)
for i, (name, args) in enumerate(CASES):
    signal.alarm(1)
    try:
        value = ["ok", getattr(m, name)(*args)]
        text = json.dumps(value)
    except BaseException as err:
        text = json.dumps(["error", type(err).__name__])
    finally:
        signal.alarm(0)
    sys.stdout = sys.stderr = io.StringIO()
    out.write("@@case " + str(i) + " " + text[:20000] + "\n"); out.flush()
'''


def _check(name: str, arguments: dict) -> None:
    if name not in _SCHEMAS:
        raise ToolError(f"unknown tool {name[:60]!r}")
    props, required = _SCHEMAS[name]["properties"], _SCHEMAS[name]["required"]
    for key, value in arguments.items():
        if key not in props:
            raise ToolError(f"{name} got an unexpected argument {key[:60]!r}")
        if not isinstance(value, str):
            raise ToolError(f"argument {key!r} must be a string")
        if len(value) > MAX_FILE_CHARS:
            raise ToolError(f"argument {key!r} is too long ({len(value)} characters, limit {MAX_FILE_CHARS})")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ToolError(f"argument {key!r} is not valid Unicode text (a lone surrogate)") from None
    for key in required:
        if key not in arguments:
            raise ToolError(f"{name} is missing the argument {key!r}")
    if "path" in arguments and not _NAME_RE.fullmatch(arguments["path"]):
        raise ToolError("a path is a plain file name in the project folder (letters, digits, _ . -; no folders)")


def read_text(folder: Path, name: str) -> str:
    """A regular file's text, refusing links, special files and big files."""
    try:
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ToolError(f"no file named {name}") from None
    except OSError as err:
        raise ToolError(f"cannot open {name} ({'a link' if err.errno == errno.ELOOP else err.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ToolError(f"{name} is not a regular file")
        data = f.read(MAX_FILE_CHARS * 4 + 1)
    if len(data) > MAX_FILE_CHARS * 4:
        raise ToolError(f"{name} is too large")
    return data.decode("utf-8", errors="replace")


def write_text(folder: Path, name: str, text: str, uid: int | None) -> None:
    try:
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        raise ToolError(f"cannot write {name} ({'a link' if err.errno == errno.ELOOP else err.strerror})") from None
    with os.fdopen(fd, "wb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ToolError(f"{name} is not a regular file")
        f.truncate(0)
        f.write(text.encode("utf-8"))
        if uid is not None:
            os.fchown(f.fileno(), uid, uid)


class CodeRepairBackend:
    """Backend of ``sinkflex/CodeRepair-v0`` (see the module docstring)."""

    def __init__(self, limits: Limits | None = None, allow_unjailed: bool = False, jail: bool | None = None):
        self.box = Sandbox(limits, jail=jail, allow_unjailed=allow_unjailed)
        self.grader = Sandbox(limits, jail=jail, allow_unjailed=allow_unjailed)
        self.task: dict | None = None
        self.split, self.index = "train", 0
        self._graded: tuple[float, dict] | None = None

    def num_tasks(self, split: str) -> int:
        return len(code_repair_tasks(split))

    def tools(self) -> list[dict]:
        return copy.deepcopy(TOOL_SCHEMAS)

    def policy(self) -> str:
        return POLICY

    def reset(self, split: str, task_index: int) -> tuple[str, dict]:
        self.split, self.index = split, task_index
        task = self.task = code_repair_tasks(split)[task_index]
        self._graded = None
        self.box.clear()
        (self.box.dir / f"{task['module']}.py").write_text(task["source"])
        (self.box.dir / f"test_{task['module']}.py").write_text(visible_test_file(task))
        self.box.handover()
        public = {k: task[k] for k in ("seed", "module", "function", "template", "question")}
        return task["question"], public

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        try:
            _check(name, arguments)
            folder = self.box.dir
            if name == "list_files":
                names = sorted(os.listdir(folder))[:MAX_FILES]
                return ToolResult("\n".join(names) if names else "(no files)")
            if name == "read_file":
                return ToolResult(read_text(folder, arguments["path"]))
            if name == "write_file":
                if arguments["path"] not in os.listdir(folder) and len(os.listdir(folder)) >= MAX_FILES:
                    raise ToolError(f"the project may hold at most {MAX_FILES} files")
                write_text(folder, arguments["path"], arguments["content"], self.box.uid)
                return ToolResult(f"Wrote {arguments['path']} ({len(arguments['content'])} characters).")
            if name == "patch_file":
                text, old = read_text(folder, arguments["path"]), arguments["old"]
                if not old:
                    raise ToolError("'old' is empty")
                count = text.count(old)
                if count != 1:
                    raise ToolError(f"'old' occurs {count} times in {arguments['path']}; it must occur exactly once")
                new_text = text.replace(old, arguments["new"])
                if len(new_text) > MAX_FILE_CHARS * 4:
                    raise ToolError("the patched file would be too large")
                write_text(folder, arguments["path"], new_text, self.box.uid)
                return ToolResult(f"Patched {arguments['path']}.")
            if name == "run_tests":
                return ToolResult(self.box.run(f"python3 test_{self.task['module']}.py").observation())
            return ToolResult("Submitted; the hidden tests will run.", done=True)
        except ToolError as err:
            return ToolResult(f"Error: {err}")

    def respond(self, text: str) -> ToolResult:
        return ToolResult("Please use the tools to fix the code, then call submit.")

    def grade(self, source: str | None) -> tuple[float, dict]:
        """Run the hidden cases against ``source`` (the module's text) in the grading sandbox."""
        task = self.task
        hidden = task["hidden"]
        if source is None:
            return 0.0, {"passed": 0, "total": len(hidden), "error": "the module is missing or unreadable"}
        self.grader.clear()
        (self.grader.dir / f"{task['module']}.py").write_text(source, errors="replace")
        (self.grader.dir / "grade_runner.py").write_text(_RUNNER.replace("{module}", task["module"]))
        self.grader.handover()
        cases = json.dumps([[c["function"], c["args"]] for c in hidden])
        result = self.grader.run(f"exec python3 -I grade_runner.py {_shell_quote(cases)}",
                                 wall_s=max(self.grader.limits.wall_s, 2.0 + len(hidden)))
        got: dict[int, object] = {}
        for line in result.output.splitlines():
            if line.startswith(_MARK):
                head, _, body = line[len(_MARK):].partition(" ")
                try:
                    got.setdefault(int(head), json.loads(body))
                except (ValueError, json.JSONDecodeError, RecursionError):
                    continue
        passed = []
        for i, case in enumerate(hidden):
            value = got.get(i)
            ok = (isinstance(value, list) and len(value) == 2 and value[0] == "ok"
                  and _safe_norm(value[1]) == case["expected"])
            passed.append(ok)
        details = {"passed": sum(passed), "total": len(hidden), "cases": passed,
                   "limits_hit": result.limits_hit, "import_error": "@@import" in result.output}
        return sum(passed) / len(hidden), details

    def reward(self) -> tuple[float, dict]:
        if self.task is None:
            return 0.0, {"error": "no task"}
        if self._graded is None:
            try:
                source = read_text(self.box.dir, f"{self.task['module']}.py")
            except ToolError:
                source = None
            self._graded = self.grade(source)
        return self._graded

    def close(self) -> None:
        self.box.close()
        self.grader.close()


def _safe_norm(value):
    try:
        return normalise_output(value)
    except (TypeError, ValueError, RecursionError):
        return object()


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


class CodeRepairExpert(ScriptedExpert):
    """Reads the module, finds a snippet that the templates plant as a bug, patches it, checks with
    the visible tests (undoing the patch and trying the next candidate if they fail), submits."""

    fallback = format_tool_call("submit", {})

    def _script(self, question: str) -> Generator[str, str, None]:
        m = re.search(r"in (\w+)\.py has a bug", question)
        if m is None:
            yield format_tool_call("submit", {})
            return
        path = m.group(1) + ".py"
        source = yield format_tool_call("read_file", {"path": path})
        for bad, good in bug_catalogue():
            if source.count(bad) != 1:
                continue
            out = yield format_tool_call("patch_file", {"path": path, "old": bad, "new": good})
            if out.startswith("Error"):
                continue
            tests = yield format_tool_call("run_tests", {})
            if tests.startswith("exit code: 0"):
                break
            yield format_tool_call("write_file", {"path": path, "content": source})  # undo
        yield format_tool_call("submit", {})
