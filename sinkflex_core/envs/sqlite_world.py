"""What the SQLite worlds (the retail store, the airline) have in common: a master database per seed,
a private copy per episode, a hash of the tables, and a backend whose reward compares that hash
with the one of the task's ground truth replayed on a fresh copy.

A world supplies its data generator, its writer and its hashed tables; a backend supplies its world,
its tools, its tasks and how an answer is recognised in a message. Everything else is here, once.
"""

from __future__ import annotations

import copy
import hashlib
import sqlite3
import threading
from collections.abc import Callable

from .base import ToolResult


def hash_tables(conn: sqlite3.Connection, tables: list[tuple[str, str, str]]) -> str:
    """SHA-256 over a canonical dump of ``tables``, each ``(table, columns, ORDER BY)``: one ``repr``
    of all rows per table, which is several times faster than hashing row by row."""
    h = hashlib.sha256()
    for table, columns, order in tables:
        rows = conn.execute(f"SELECT {columns} FROM {table} ORDER BY {order}").fetchall()
        h.update(table.encode() + b"\n" + repr(rows).encode() + b"\n")
    return h.hexdigest()


class SQLiteWorld:
    """A generated world: its plain-Python ``data`` plus a master in-memory SQLite copy.

    Subclasses set ``generate(seed) -> data``, ``write(data, conn)`` and ``state_hash(conn)`` (as
    static methods). ``get(seed)`` returns the process-wide instance of a seed (made on first use,
    one cache per subclass); :meth:`new_episode_db` returns a private copy of the master.
    """

    _cache: dict[int, SQLiteWorld]
    _lock: threading.Lock

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._cache, cls._lock = {}, threading.Lock()

    generate: Callable
    write: Callable
    state_hash: Callable

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.data = self.generate(seed)
        self._master = sqlite3.connect(":memory:", check_same_thread=False)
        self.write(self.data, self._master)
        self._master_lock = threading.Lock()
        self.initial_hash = self.state_hash(self._master)
        # ground-truth hashes by (split, task index), filled by SQLiteBackend.expected_hash
        self.expected: dict[tuple[str, int], str] = {}
        self.expected_lock = threading.Lock()

    @classmethod
    def get(cls, seed: int = 0):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"world seed must be an int, got {seed!r}")
        with cls._lock:
            if seed not in cls._cache:
                cls._cache[seed] = cls(seed)
            return cls._cache[seed]

    def new_episode_db(self) -> sqlite3.Connection:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        with self._master_lock:
            self._master.backup(conn)
        return conn


class SQLiteBackend:
    """An episode over a private copy of a :class:`SQLiteWorld`: tools, a customer and the reward.

    Reward: 1.0 when the database after the episode hashes to the same value as the initial one with
    the task's ground-truth actions replayed on it, every required output is given in some message
    the agent sent to the customer (``answer_given(output, message)``), and the records those answers
    are about were read in the episode (:meth:`required_reads`); 0.0 otherwise.

    Subclasses set ``tools_class`` (built on a connection; ``call(name, arguments) -> ToolResult``),
    ``tool_schemas``, ``splits``, ``read_tools``, and the static methods ``get_tasks(seed, split)`` and
    ``answer_given(output, message)``, and call ``__init__`` with their world, customer factory and
    policy text.
    """

    tools_class: type
    tool_schemas: list[dict]
    splits: tuple[str, ...]
    get_tasks: Callable
    answer_given: Callable
    #: The tools that read a record an answer can rest on, each with the arguments that name the record:
    #: every successful call is remembered for the episode as ``(tool, *those arguments)``.
    read_tools: dict[str, tuple[str, ...]] = {}

    def __init__(self, world: SQLiteWorld, customer_factory: Callable[[dict], object], policy: str):
        self.world = world
        self.customer_factory = customer_factory
        self._policy = policy
        self.conn = None
        self.tools_impl = None
        self.split, self.index = "train", 0
        self.reads: set[tuple] = set()

    @classmethod
    def expected_hash(cls, world: SQLiteWorld, split: str, index: int) -> str:
        """Hash of the initial database with the task's ground-truth actions replayed (cached)."""
        with world.expected_lock:
            if (split, index) in world.expected:
                return world.expected[(split, index)]
        task = cls.get_tasks(world.seed, split)[index]
        if not task["actions"]:
            return world.initial_hash
        conn = world.new_episode_db()
        tools = cls.tools_class(conn)
        for action in task["actions"]:
            out = tools.call(action["name"], action["arguments"]).output
            if out.startswith("Error"):
                raise RuntimeError(f"ground truth of {task['task_id']} fails: {action} -> {out}")
        value = world.state_hash(conn)
        conn.close()
        with world.expected_lock:
            world.expected[(split, index)] = value
        return value

    def num_tasks(self, split: str) -> int:
        return len(self.get_tasks(self.world.seed, split))

    def task(self, split: str, index: int) -> dict:
        return self.get_tasks(self.world.seed, split)[index]

    def tools(self) -> list[dict]:
        return copy.deepcopy(self.tool_schemas)

    def policy(self) -> str:
        return self._policy

    def reset(self, split: str, task_index: int) -> tuple[str, dict]:
        if self.conn is not None:
            self.conn.close()
        self.conn = self.world.new_episode_db()
        self.tools_impl = self.tools_class(self.conn)
        self.split, self.index = split, task_index
        task = self.task(split, task_index)
        self.customer = self.customer_factory(task)
        self.agent_messages: list[str] = []
        self.reads: set[tuple] = set()
        return self.customer.opening(), task

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        if self.tools_impl is None:
            return ToolResult("Error: no episode is running")
        result = self.tools_impl.call(name, arguments)
        if name in self.read_tools and not result.output.startswith("Error"):
            self.reads.add((name, *(arguments[k] for k in self.read_tools[name])))
        return result

    def required_reads(self, task: dict) -> list[tuple]:
        """The reads (``(tool, *arguments)``, as :attr:`read_tools` records them) that the task's required
        outputs rest on: an answer about a record counts only once the agent has read that record, so that
        a message repeated whatever the customer asks ("the order is delivered") does not earn the tasks
        whose answer it happens to be. Default: none."""
        return []

    def respond(self, text: str) -> ToolResult:
        self.agent_messages.append(text)
        reply, done = self.customer.reply(text)
        return ToolResult(reply, done)

    def reward(self) -> tuple[float, dict]:
        task = self.task(self.split, self.index)
        # an episode that wrote nothing needs no dump of the tables (grading is most of an episode's time)
        final = self.world.state_hash(self.conn) if self.conn.total_changes else self.world.initial_hash
        db_match = final == self.expected_hash(self.world, self.split, self.index)
        found = [any(self.answer_given(o, m) for m in self.agent_messages) for o in task["outputs"]]
        looked_up = all(read in self.reads for read in self.required_reads(task))
        return float(db_match and all(found) and looked_up), {
            "db_match": db_match, "outputs": list(task["outputs"]), "outputs_found": found,
            "answers_looked_up": looked_up, "db_changed": final != self.world.initial_hash}

    def integrity_check(self) -> str:
        return self.conn.execute("PRAGMA integrity_check").fetchone()[0]

    def state_hash(self) -> str:
        return self.world.state_hash(self.conn)

    def close(self) -> None:
        self.tools_impl = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
