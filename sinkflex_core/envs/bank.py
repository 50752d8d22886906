"""``sinkflex/BankSQL-v0``: answer a question about a small bank database with read-only SQL.

The agent sees the question, can list the schema and run read-only queries, and answers by
submitting one SQL query with ``submit_answer``; the reward is 1.0 when that query's result set
equals the ground-truth query's (rows compared as a multiset, numbers rounded to 2 decimals), else
0.0. Writes are impossible: an authorizer lets only SELECT reach the database, ``query_only`` is on.

Every query is bounded (``docs/limits.md`` lists the figures): a wall-clock deadline and a step count,
checked between SQLite's virtual-machine steps; a length limit on every value, a short LIKE/GLOB
pattern limit and a guarded ``printf``/``format``, so that no single function call can run for long
either; and caps on the rows and bytes a result may return. A query that hits a limit gets an
``Error: ...`` observation naming the limit.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Generator
from functools import lru_cache

from .base import ScriptedExpert, ToolResult, format_tool_call
from .retail_tools import ToolError, check_arguments

MAX_ROWS_SHOWN = 20
MAX_ROWS_GRADED = 5_000
MAX_VM_STEPS = 2_000_000
QUERY_SECONDS = 2.0
# Per value (string or blob). The cost of one SQL function call grows with its inputs' lengths (LIKE
# and instr() are quadratic), so this bound is also what keeps a single call short.
MAX_VALUE_BYTES = 10_000
MAX_LIKE_PATTERN = 200
MAX_RESULT_BYTES = 1_000_000
MAX_SQL_CHARS = 10_000
MAX_COLUMNS = 100
N_TRAIN, N_TEST = 600, 120

BRANCHES = ["Downtown", "Harbor", "Uptown", "Airport", "Riverside", "Hillside", "Old Town", "Lakeside"]
CITIES = ["Austin", "Denver", "Seattle", "Boston", "Phoenix", "Chicago", "Portland", "Atlanta"]
FIRST = ["Ana", "Ben", "Carla", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jon", "Kim", "Lea", "Max", "Nia",
         "Oto", "Pia", "Quin", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Xia", "Yan", "Zoe"]
LAST = ["Ortiz", "Park", "Quinn", "Reyes", "Stone", "Tran", "Urban", "Vega", "Ward", "Young", "Zhou", "Abbott",
        "Baker", "Cole", "Diaz", "Ellis", "Ford", "Grant"]
KINDS = ["checking", "savings", "credit"]
CATEGORIES = ["salary", "rent", "groceries", "travel", "utilities", "dining", "transfer"]
LOAN_STATUS = ["active", "paid", "default"]

SCHEMA = """CREATE TABLE branches (branch_id INTEGER PRIMARY KEY, name TEXT, city TEXT);
CREATE TABLE customers (customer_id INTEGER PRIMARY KEY, first_name TEXT, last_name TEXT, city TEXT, birth_year INTEGER, branch_id INTEGER);
CREATE TABLE accounts (account_id INTEGER PRIMARY KEY, customer_id INTEGER, kind TEXT, opened TEXT, balance_cents INTEGER);
CREATE TABLE transactions (txn_id INTEGER PRIMARY KEY, account_id INTEGER, date TEXT, amount_cents INTEGER, category TEXT);
CREATE TABLE loans (loan_id INTEGER PRIMARY KEY, customer_id INTEGER, amount_cents INTEGER, rate REAL, status TEXT);"""

POLICY = f"""You answer questions about a bank's database with SQL (SQLite dialect).
Run read-only queries with run_sql to explore; answer by calling submit_answer with one SELECT query whose
result is exactly the answer (only the asked columns, no extra rows). Each turn is one tool call.
Amounts are integer cents; dates are 'YYYY-MM-DD' text.

Schema:
{SCHEMA}"""

TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "list_tables", "description": "Show the database schema.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {"name": "run_sql", "description": "Run one read-only SQL query; "
                                      f"returns the columns and at most {MAX_ROWS_SHOWN} rows.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
    {"type": "function", "function": {"name": "submit_answer", "description": "Submit the SQL query whose "
                                      "result answers the question; ends the episode.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
]
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}


def build_bank_db(seed: int = 0) -> sqlite3.Connection:
    """The bank database drawn from ``seed`` (8 branches, 200 customers, ~400 accounts, ~4,000
    transactions, ~120 loans), in memory."""
    rng = random.Random(f"bank-{seed}")
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO branches VALUES (?,?,?)",
                     [(i + 1, name, CITIES[i % len(CITIES)]) for i, name in enumerate(BRANCHES)])
    names = set()
    customers = []
    while len(customers) < 200:
        first, last = rng.choice(FIRST), rng.choice(LAST)
        if (first, last) in names:
            continue
        names.add((first, last))
        customers.append((len(customers) + 1, first, last, rng.choice(CITIES), rng.randint(1950, 2004),
                          rng.randint(1, len(BRANCHES))))
    conn.executemany("INSERT INTO customers VALUES (?,?,?,?,?,?)", customers)
    accounts, txns, loans = [], [], []
    for c in customers:
        for kind in rng.sample(KINDS, rng.randint(1, 3)):
            aid = 1000 + len(accounts)
            opened = f"{rng.randint(2015, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            accounts.append((aid, c[0], kind, opened, rng.randint(-50_000, 2_000_000)))
            for _ in range(rng.randint(2, 18)):
                cat = rng.choice(CATEGORIES)
                amount = rng.randint(1_000, 400_000) * (1 if cat in ("salary", "transfer") else -1)
                date = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                txns.append((len(txns) + 1, aid, date, amount, cat))
        if rng.random() < 0.6:
            loans.append((len(loans) + 1, c[0], rng.randint(100, 500) * 10_000, round(rng.uniform(2, 12), 2),
                           rng.choice(LOAN_STATUS)))
    conn.executemany("INSERT INTO accounts VALUES (?,?,?,?,?)", accounts)
    conn.executemany("INSERT INTO transactions VALUES (?,?,?,?,?)", txns)
    conn.executemany("INSERT INTO loans VALUES (?,?,?,?,?)", loans)
    conn.commit()
    return conn


# ---- questions: (template, SQL template, parameter drawer) --------------------------------------

def _q(conn, sql, args=()):
    return conn.execute(sql, args).fetchall()


QUESTIONS = [
    ("How many customers live in {city}?",
     "SELECT COUNT(*) FROM customers WHERE city = '{city}'",
     lambda rng, c: {"city": rng.choice(CITIES)}),
    ("List the account ids of customer {first} {last}.",
     "SELECT a.account_id FROM accounts a JOIN customers c ON a.customer_id = c.customer_id "
     "WHERE c.first_name = '{first}' AND c.last_name = '{last}'",
     lambda rng, c: dict(zip(("first", "last"), rng.choice(_q(c, "SELECT first_name, last_name FROM customers"))))),
    ("What is the total balance in cents of all {kind} accounts?",
     "SELECT SUM(balance_cents) FROM accounts WHERE kind = '{kind}'",
     lambda rng, c: {"kind": rng.choice(KINDS)}),
    ("How many {category} transactions happened in month {month} of 2024?",
     "SELECT COUNT(*) FROM transactions WHERE category = '{category}' AND substr(date, 6, 2) = '{month}'",
     lambda rng, c: {"category": rng.choice(CATEGORIES), "month": f"{rng.randint(1, 12):02d}"}),
    ("Which customers have a {kind} account with a balance above {cents} cents? Give first and last names.",
     "SELECT DISTINCT c.first_name, c.last_name FROM customers c JOIN accounts a ON a.customer_id = c.customer_id "
     "WHERE a.kind = '{kind}' AND a.balance_cents > {cents}",
     lambda rng, c: {"kind": rng.choice(KINDS), "cents": rng.randint(15, 19) * 100_000}),
    ("What is the sum in cents of all transactions of account {account}?",
     "SELECT SUM(amount_cents) FROM transactions WHERE account_id = {account}",
     lambda rng, c: {"account": rng.choice(_q(c, "SELECT account_id FROM accounts"))[0]}),
    ("How many {status} loans do customers of the {branch} branch have?",
     "SELECT COUNT(*) FROM loans l JOIN customers c ON l.customer_id = c.customer_id JOIN branches b "
     "ON c.branch_id = b.branch_id WHERE b.name = '{branch}' AND l.status = '{status}'",
     lambda rng, c: {"status": rng.choice(LOAN_STATUS), "branch": rng.choice(BRANCHES)}),
    ("Which customers of the {branch} branch were born before {year}? Give first and last names.",
     "SELECT c.first_name, c.last_name FROM customers c JOIN branches b ON c.branch_id = b.branch_id "
     "WHERE b.name = '{branch}' AND c.birth_year < {year}",
     lambda rng, c: {"branch": rng.choice(BRANCHES), "year": rng.randint(1955, 1975)}),
    ("What is the average rate of {status} loans, rounded to 2 decimals?",
     "SELECT ROUND(AVG(rate), 2) FROM loans WHERE status = '{status}'",
     lambda rng, c: {"status": rng.choice(LOAN_STATUS)}),
    ("How many accounts were opened in {year}?",
     "SELECT COUNT(*) FROM accounts WHERE substr(opened, 1, 4) = '{year}'",
     lambda rng, c: {"year": str(rng.randint(2015, 2024))}),
    ("What is the largest balance in cents among accounts of customers living in {city}?",
     "SELECT MAX(a.balance_cents) FROM accounts a JOIN customers c ON a.customer_id = c.customer_id "
     "WHERE c.city = '{city}'",
     lambda rng, c: {"city": rng.choice(CITIES)}),
    ("How many customers have no loan?",
     "SELECT COUNT(*) FROM customers WHERE customer_id NOT IN (SELECT customer_id FROM loans)",
     lambda rng, c: {}),
]


def _question_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name in re.findall(r"\{(\w+)\}", template):
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>.+?)", 1)
    return re.compile("^" + pattern + "$")


_QUESTION_RES = [(_question_regex(t), sql) for t, sql, _ in QUESTIONS]


def question_to_sql(question: str) -> str | None:
    """The SQL for a question written from one of the templates (what the oracle uses)."""
    for pattern, sql in _QUESTION_RES:
        m = pattern.match(question.strip())
        if m:
            return sql.format(**m.groupdict())
    return None


_DB_CACHE: dict[int, sqlite3.Connection] = {}
_DB_LOCK = threading.Lock()


def bank_db(seed: int = 0) -> sqlite3.Connection:
    with _DB_LOCK:
        if seed not in _DB_CACHE:
            _DB_CACHE[seed] = build_bank_db(seed)
        return _DB_CACHE[seed]


@lru_cache(maxsize=4)
def bank_tasks(seed: int, split: str) -> tuple:
    """The split's questions (train and test never share a question), each with its SQL and answer rows."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    conn = bank_db(seed)
    rng = random.Random(f"bank-tasks-{seed}")
    seen, tasks = set(), {"train": [], "test": []}
    attempts = 0
    while len(tasks["train"]) < N_TRAIN or len(tasks["test"]) < N_TEST:
        attempts += 1
        if attempts > 50_000:
            break
        template, sql, draw = rng.choice(QUESTIONS)
        params = draw(rng, conn)
        question = template.format(**params)
        if question in seen:
            continue
        seen.add(question)
        target = "test" if len(tasks["test"]) < N_TEST and rng.random() < 0.2 else "train"
        if len(tasks[target]) >= (N_TEST if target == "test" else N_TRAIN):
            target = "train" if target == "test" else "test"
        query = sql.format(**params)
        tasks[target].append({"task_id": f"bank-{target}-{len(tasks[target]):04d}", "question": question,
                              "sql": query, "answer": [list(r) for r in conn.execute(query).fetchall()]})
    return tuple(tasks[split])


def _normalise(rows) -> Counter:
    def cell(v):
        return round(v, 2) if isinstance(v, float) else v
    return Counter(tuple(cell(v) for v in row) for row in rows)


def _row_bytes(row: tuple) -> int:
    """What a result row costs to keep, roughly: text and blobs by length, other cells 8 bytes."""
    return sum(len(v) if isinstance(v, str | bytes) else 8 for v in row)


# one conversion of SQLite's printf: flags, width (digits or *), precision (digits or *), size, type
_PRINTF_SPEC = re.compile(r"%([-+ 0#!,]*)(\*|\d+)?(?:\.(\*|\d*))?(l{0,2})(.?)", re.S)


_NUMERIC_PREFIX = re.compile(r"\s*[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _as_int(value) -> int:
    """At least the integer SQLite reads from a printf argument: the number a text or blob starts with
    ("1000000000abc" counts), infinity as a huge number, 0 for what holds no number."""
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str):
        m = _NUMERIC_PREFIX.match(value)
        if m is None:
            return 0
        value = float(m.group())
    try:
        return int(value)
    except OverflowError:  # infinity: SQLite reads the largest integer
        return 2**63 - 1
    except (TypeError, ValueError):  # NaN, None
        return 0


def printf_widths(fmt: str, args: tuple) -> list[int]:
    """Every width and precision a ``printf(fmt, *args)`` call asks for (``*`` read from ``args``)."""
    out, i = [], 0
    for m in _PRINTF_SPEC.finditer(fmt):
        _, width, precision, _, kind = m.groups()
        if kind == "%":
            continue
        for part in (width, precision):
            if part == "*":
                out.append(abs(_as_int(args[i])) if i < len(args) else 0)
                i += 1
            elif part:
                out.append(int(part))
        i += 1  # the value converted
    return out


class _LimitHit(Exception):
    """Raised inside a guarded SQL function; the query fails with this message."""


class BankBackend:
    """Backend of ``sinkflex/BankSQL-v0`` (see the module docstring)."""

    def __init__(self, db_seed: int = 0):
        self.seed = db_seed
        master = bank_db(db_seed)
        # a private read-only copy per environment, so no query can reach another environment's state
        self.conn = sqlite3.connect(":memory:", check_same_thread=False)
        master.backup(self.conn)
        self.conn.execute("PRAGMA query_only = ON")
        self.conn.set_authorizer(self._authorize)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_LIKE_PATTERN)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)  # bounds one row: columns x value length
        # SQLite's printf loops over a huge width or precision (seconds for '%.*c' with 10**9) before
        # its length limit applies, and no deadline can stop one call: refuse such formats first, then
        # format with the real printf of a connection that holds no data.
        self._printf_conn = sqlite3.connect(":memory:", check_same_thread=False)
        self._printf_conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        self._limit_hit: str | None = None
        for fn in ("printf", "format"):
            self.conn.create_function(fn, -1, self._guarded_printf, deterministic=True)
        self.submitted: str | None = None
        self.submitted_rows: list | None = None
        self.split, self.index = "train", 0

    def _guarded_printf(self, fmt=None, *args):
        if fmt is None:
            return None
        fmt = fmt if isinstance(fmt, str) else str(fmt)
        if any(w > MAX_VALUE_BYTES for w in printf_widths(fmt, args)):
            self._limit_hit = f"a printf width or precision above {MAX_VALUE_BYTES:,} (the value length limit)"
            raise _LimitHit(self._limit_hit)
        marks = ",".join("?" * (len(args) + 1))
        try:
            return self._printf_conn.execute(f"SELECT printf({marks})", (fmt, *args)).fetchone()[0]
        except sqlite3.DataError as err:
            self._limit_hit = f"a value longer than {MAX_VALUE_BYTES:,} bytes"
            raise _LimitHit(self._limit_hit) from err
        except sqlite3.Error as err:
            self._limit_hit = f"a printf error ({str(err)[:80]})"
            raise _LimitHit(self._limit_hit) from err

    @staticmethod
    def _authorize(action, arg1, arg2, dbname, source):
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                      sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY

    def num_tasks(self, split: str) -> int:
        return len(bank_tasks(self.seed, split))

    def tools(self) -> list[dict]:
        return json.loads(json.dumps(TOOL_SCHEMAS))

    def policy(self) -> str:
        return POLICY

    def reset(self, split: str, task_index: int) -> tuple[str, dict]:
        self.split, self.index = split, task_index
        self.submitted = None
        self.submitted_rows = None  # the last episode's answer may be up to MAX_RESULT_BYTES
        task = bank_tasks(self.seed, split)[task_index]
        return task["question"], dict(task)

    def _run(self, query: str, max_rows: int, more_is_error: bool) -> tuple[list[str], list[tuple], bool]:
        """Run ``query`` within every limit; ``(columns, at most max_rows rows, whether rows were left)``.

        With ``more_is_error`` a result of more than ``max_rows`` rows is refused instead of cut."""
        # the authorizer is the real guard; this gives a clearer message for the common mistakes
        head = re.sub(r"(--[^\n]*\n|/\*.*?\*/|\s|\()+", " ", query, flags=re.S).strip().split(" ")[0].lower()
        if head not in ("select", "with", "values"):
            raise ToolError("only read-only SELECT queries are allowed")
        deadline = time.monotonic() + QUERY_SECONDS
        steps = [0]
        self._limit_hit = None

        def progress():  # called every 1,000 virtual-machine steps
            steps[0] += 1
            if steps[0] > MAX_VM_STEPS // 1000:
                self._limit_hit = f"more than {MAX_VM_STEPS:,} steps"
                return 1
            if time.monotonic() > deadline:
                self._limit_hit = f"the {QUERY_SECONDS:g} s deadline"
                return 1
            return 0

        self.conn.set_progress_handler(progress, 1000)
        cur, rows, size, more = None, [], 0, False
        try:
            cur = self.conn.execute(query)
            cols = [d[0] for d in cur.description or []]
            while not more:
                chunk = cur.fetchmany(64)
                if not chunk:
                    break
                for row in chunk:
                    if len(rows) == max_rows:
                        if more_is_error:
                            raise ToolError(f"the result has more than {max_rows:,} rows (limit)")
                        more = True
                        break
                    size += _row_bytes(row)
                    if size > MAX_RESULT_BYTES:
                        raise ToolError(f"the result is larger than {MAX_RESULT_BYTES:,} bytes (limit)")
                    rows.append(row)
        except MemoryError as err:
            rows = []
            raise ToolError("the query ran out of memory") from err
        except sqlite3.Error as err:
            msg = str(err)
            if self._limit_hit is not None:
                msg = f"the query was stopped: it reached {self._limit_hit}"
            elif "too big" in msg:
                msg = f"a value would be longer than {MAX_VALUE_BYTES:,} bytes (limit)"
            raise ToolError(msg[:200]) from err
        except (sqlite3.Warning, ValueError, OverflowError) as err:  # e.g. two statements in one query
            raise ToolError(str(err)[:200]) from err
        finally:
            self.conn.set_progress_handler(None, 0)
            if cur is not None:
                cur.close()
        return cols, rows, more

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        try:
            check_arguments(name, arguments, _SCHEMAS)
            if name == "list_tables":
                return ToolResult(SCHEMA)
            if name == "run_sql":
                cols, rows, more = self._run(arguments["query"], MAX_ROWS_SHOWN, more_is_error=False)
            else:
                cols, rows, more = self._run(arguments["query"], MAX_ROWS_GRADED, more_is_error=True)
        except ToolError as err:
            return ToolResult(f"Error: {err}")
        if name == "submit_answer":
            self.submitted_rows = rows
            self.submitted = arguments["query"]
            return ToolResult("Answer recorded.", done=True)
        out = {"columns": cols, "rows": [list(r) for r in rows]}
        if more:
            out["truncated"] = True
        text = json.dumps(out, separators=(",", ":"), default=str)
        return ToolResult(text if len(text) < 8000 else text[:8000] + " ...[cut]")

    def respond(self, text: str) -> ToolResult:
        return ToolResult("Please answer by calling submit_answer with a SQL query.")

    def reward(self) -> tuple[float, dict]:
        task = bank_tasks(self.seed, self.split)[self.index]
        if self.submitted is None:
            return 0.0, {"submitted": None, "match": False}
        match = _normalise(self.submitted_rows) == _normalise(task["answer"])
        return float(match), {"submitted": self.submitted, "match": match}

    def integrity_check(self) -> str:
        """``PRAGMA integrity_check`` (the authorizer that forbids PRAGMAs is lifted for it)."""
        self.conn.set_authorizer(None)
        try:
            return self.conn.execute("PRAGMA integrity_check").fetchone()[0]
        finally:
            self.conn.set_authorizer(self._authorize)

    def state_hash(self) -> str:
        """SHA-256 over every table, rows in primary-key order (it must never change)."""
        import hashlib

        h = hashlib.sha256()
        for (table,) in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
            h.update(table.encode())
            for row in self.conn.execute(f"SELECT * FROM {table} ORDER BY 1"):
                h.update(repr(row).encode())
        return h.hexdigest()

    def close(self) -> None:
        self.submitted_rows = None
        if self.conn is not None:  # the environment's private copy of the database
            self.conn.close()
            self.conn = None
            self._printf_conn.close()


class BankOracle(ScriptedExpert):
    """Turns the question into SQL, runs it once, submits it."""

    fallback = "I cannot answer this question."

    def _script(self, question: str) -> Generator[str, str, None]:
        sql = question_to_sql(question)
        if sql is None:
            yield "I cannot answer this question."
            return
        yield format_tool_call("run_sql", {"query": sql})
        yield format_tool_call("submit_answer", {"query": sql})
