"""The tasks of ``sinkflex/CodeRepair-v0``: a small Python module with one planted bug.

A task is drawn from a seed: one buggy function (a template, its name, its constants) and one or two
correct functions beside it, a module name, a visible test file and hidden test cases (inputs and
expected outputs). Expected outputs come from running the correct source here, in this process: it
is generated from the templates below, never from anything an agent wrote. Every task is checked
when it is made: the visible tests fail on the bug and the hidden ones pass on the fix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache

N_TRAIN, N_TEST = 400, 100
_TEST_SEED0 = 1_000_000
MODULES = ["mathutils", "utils", "textkit", "listops", "numtools", "misc", "core", "stats", "strutil", "algos"]


@dataclass(frozen=True)
class Template:
    """A function: ``source`` (with ``{f}`` for its name and ``{k}`` for a constant), the snippet the
    bug replaces and what it is replaced with, and a drawer of argument tuples."""

    names: tuple[str, ...]
    source: str
    good: str
    bad: str
    args: object  # (random.Random, k) -> tuple
    constants: tuple[int, ...] = (0,)


def _ints(rng, n=None, lo=-20, hi=40):
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, 8) if n is None else n)]


def _word(rng):
    return "".join(rng.choice("abcdeiourstlmn") for _ in range(rng.randint(1, 7)))


def _text(rng):
    return " ".join(_word(rng).capitalize() if rng.random() < 0.3 else _word(rng) for _ in range(rng.randint(0, 5)))


TEMPLATES = [
    Template(("mean", "average", "avg"), "def {f}(values):\n    if not values:\n        return 0.0\n"
             "    return sum(values) / len(values)\n", "sum(values) / len(values)", "sum(values) // len(values)",
             lambda r, k: (_ints(r, r.randint(1, 6)),)),
    Template(("factorial", "fact", "product_upto"), "def {f}(n):\n    out = 1\n    for k in range(1, n + 1):\n"
             "        out *= k\n    return out\n", "range(1, n + 1)", "range(1, n)", lambda r, k: (r.randint(0, 9),)),
    Template(("clamp", "bound", "limit"), "def {f}(value, low, high):\n    return max(low, min(value, high))\n",
             "max(low, min(value, high))", "min(low, max(value, high))",
             lambda r, k: (r.randint(-30, 30), r.randint(-10, 0), r.randint(1, 10))),
    Template(("is_palindrome", "palindrome", "reads_same"), "def {f}(text):\n"
             "    cleaned = [c.lower() for c in text if c.isalnum()]\n    return cleaned == cleaned[::-1]\n",
             "[c.lower() for c in text", "[c for c in text",
             lambda r, k: (r.choice(["Abba", "Noon", "racecar", "Step on no pets", "abc", "Level", "xy", "A"]),)),
    Template(("count_vowels", "vowels", "n_vowels"), "def {f}(text):\n"
             "    return sum(1 for c in text.lower() if c in \"aeiou\")\n", "c in text.lower() if c in", "c in text if c in",
             lambda r, k: (_text(r),)),
    Template(("running_total", "cumsum", "prefix_sums"), "def {f}(values):\n    total, out = 0, []\n"
             "    for v in values:\n        total += v\n        out.append(total)\n    return out\n",
             "        total += v\n        out.append(total)\n", "        out.append(total)\n        total += v\n",
             lambda r, k: (_ints(r, r.randint(1, 6)),)),
    Template(("binary_search", "find_sorted", "bsearch"), "def {f}(items, target):\n    lo, hi = 0, len(items) - 1\n"
             "    while lo <= hi:\n        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
             "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
             "    return -1\n", "while lo <= hi:", "while lo < hi:",
             lambda r, k: (lambda xs: (xs, r.choice(xs + [99])))(sorted(set(_ints(r, r.randint(1, 7)))))),
    Template(("fizz", "buzz_list", "fizzbuzz"), "def {f}(n):\n    out = []\n    for i in range(1, n + 1):\n"
             "        if i % 3 == 0 and i % {k} == 0:\n            out.append(\"both\")\n        elif i % 3 == 0:\n"
             "            out.append(\"three\")\n        elif i % {k} == 0:\n            out.append(\"other\")\n"
             "        else:\n            out.append(i)\n    return out\n", "0 and i", "0 or i",
             lambda r, k: (r.randint(1, 16),), (4, 5, 7)),
    Template(("word_count", "count_words", "n_words"), "def {f}(text):\n    return len(text.split())\n",
             "text.split())", "text.split(\" \"))",
             lambda r, k: (r.choice(["a  b", " lead", "x y z", "", "one", "two  spaces  here", "tab\tsep"]),)),
    Template(("median", "middle", "med"), "def {f}(values):\n    ordered = sorted(values)\n    n = len(ordered)\n"
             "    if n % 2:\n        return ordered[n // 2]\n    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2\n",
             "ordered = sorted(values)", "ordered = list(values)", lambda r, k: (_ints(r, r.randint(1, 7)),)),
    Template(("gcd", "common_divisor", "hcf"), "def {f}(a, b):\n    while b:\n        a, b = b, a % b\n"
             "    return abs(a)\n", "a, b = b, a % b", "a, b = b, b % a",
             lambda r, k: (r.randint(1, 60) * r.choice([1, 2, 3, 6]), r.randint(1, 60))),
    Template(("fib", "fibonacci", "nth_fib"), "def {f}(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
             "        a, b = b, a + b\n    return a\n", "    return a\n", "    return b\n", lambda r, k: (r.randint(0, 15),)),
    Template(("second_largest", "runner_up", "next_best"), "def {f}(values):\n    uniq = sorted(set(values))\n"
             "    return uniq[-2] if len(uniq) > 1 else None\n", "uniq = sorted(set(values))", "uniq = sorted(values)",
             lambda r, k: (lambda xs: (xs + [max(xs)],))(_ints(r, r.randint(2, 6)))),
    Template(("caesar", "shift_text", "rotate_letters"), "def {f}(text):\n    out = []\n    for c in text:\n"
             "        if c.islower():\n            out.append(chr((ord(c) - 97 + {k}) % 26 + 97))\n        else:\n"
             "            out.append(c)\n    return \"\".join(out)\n", "+ {k}) % 26 + 97", "+ {k}) + 97",
             lambda r, k: (r.choice(["xyz", "hello world", "zebra", "Quiz", "wax", "abc"]),), (3, 5, 13)),
    Template(("chunk", "batches", "split_every"), "def {f}(items):\n"
             "    return [items[i:i + {k}] for i in range(0, len(items), {k})]\n", "range(0, len(items), {k})",
             "range(0, len(items) - {k}, {k})", lambda r, k: (_ints(r, r.randint(0, 9)),), (2, 3)),
    Template(("dedupe", "unique", "distinct"), "def {f}(items):\n    seen, out = set(), []\n    for x in items:\n"
             "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out\n",
             "    return out\n", "    return sorted(out)\n", lambda r, k: (_ints(r, r.randint(2, 8), 0, 9),)),
    Template(("to_fahrenheit", "c_to_f", "fahrenheit"), "def {f}(celsius):\n    return celsius * 9 / 5 + 32\n",
             "celsius * 9 / 5", "celsius * 5 / 9", lambda r, k: (r.randint(-40, 100),)),
    Template(("title_case", "capitalise", "titled"), "def {f}(text):\n"
             "    return \" \".join(w.capitalize() for w in text.split())\n", "w.capitalize()", "w.upper()",
             lambda r, k: (_text(r),)),
    Template(("spread", "value_range", "span"), "def {f}(values):\n    return max(values) - min(values)\n",
             "max(values) - min(values)", "max(values) - values[0]", lambda r, k: (_ints(r, r.randint(1, 6)),)),
    Template(("count_above", "n_over", "above_limit"), "def {f}(values):\n    return sum(1 for v in values if v > {k})\n",
             "v > {k}", "v >= {k}", lambda r, k: (_ints(r, r.randint(1, 6), k - 2, k + 2),), (5, 10, 20)),
    Template(("digit_sum", "sum_digits", "digits_total"), "def {f}(n):\n    n, total = abs(n), 0\n    while n:\n"
             "        total += n % 10\n        n //= 10\n    return total\n", "n //= 10", "n //= 100",
             lambda r, k: (r.randint(-999, 99_999),)),
    Template(("is_prime", "prime", "check_prime"), "def {f}(n):\n    if n < 2:\n        return False\n"
             "    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n            return False\n"
             "    return True\n", "int(n ** 0.5) + 1)", "int(n ** 0.5))", lambda r, k: (r.randint(0, 60),)),
    Template(("reverse_words", "flip_words", "backwards"), "def {f}(text):\n"
             "    return \" \".join(reversed(text.split()))\n", "reversed(text.split())", "sorted(text.split())",
             lambda r, k: (_text(r),)),
    Template(("last_index", "rfind_item", "last_position"), "def {f}(items, target):\n"
             "    for i in range(len(items) - 1, -1, -1):\n        if items[i] == target:\n            return i\n"
             "    return -1\n", "range(len(items) - 1, -1, -1)", "range(len(items) - 1, 0, -1)",
             lambda r, k: (lambda xs: (xs, r.choice(xs)))(_ints(r, r.randint(1, 6), 0, 4))),
]


def _norm(value):
    """Outputs compared as JSON (tuples become lists), floats to 6 decimals."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _norm(v) for k, v in value.items()}
    return value


def normalise_output(value):
    return _norm(json.loads(json.dumps(value)))


def _function(template: Template, name: str, k: int, buggy: bool) -> str:
    src = template.source.replace("{f}", name).replace("{k}", str(k))
    good, bad = template.good.replace("{k}", str(k)), template.bad.replace("{k}", str(k))
    assert src.count(good) == 1 and bad not in src, (name, good)
    return src.replace(good, bad) if buggy else src


def _scope(source: str) -> dict:
    scope: dict = {}
    exec(compile(source, "<template>", "exec"), scope)  # our own template source, never agent code
    return scope


def _run(scope: dict, name: str, args: tuple):
    try:
        return normalise_output(scope[name](*args))
    except Exception as err:  # a buggy variant may raise: that is a failing case
        return f"raised {type(err).__name__}"


def make_task(seed: int) -> dict:
    """The task of a seed (see the module docstring)."""
    rng = random.Random(f"code-repair-{seed}")
    picked = rng.sample(range(len(TEMPLATES)), rng.randint(2, 3))
    module = rng.choice(MODULES)
    funcs = []
    for j, t_index in enumerate(picked):
        t = TEMPLATES[t_index]
        funcs.append({"template": t_index, "name": rng.choice(t.names), "k": rng.choice(t.constants),
                      "buggy": j == 0})
    rng.shuffle(funcs)
    good_src = "\n\n".join(_function(TEMPLATES[f["template"]], f["name"], f["k"], False) for f in funcs)
    bad_src = "\n\n".join(_function(TEMPLATES[f["template"]], f["name"], f["k"], f["buggy"]) for f in funcs)
    header = f'"""Small utilities ({module})."""\n\n\n'
    good, bad = _scope(good_src), _scope(bad_src)
    bug = next(f for f in funcs if f["buggy"])
    t = TEMPLATES[bug["template"]]
    cases: list[tuple[str, tuple]] = []
    for f in funcs:  # hidden: 8 cases of the buggy function (as few as possible passing on the bug), 2 of each other
        tf, seen = TEMPLATES[f["template"]], set()
        want = 8 if f["buggy"] else 2
        quiet, tries = 0, 0
        while sum(c[0] == f["name"] for c in cases) < want and tries < 400:
            tries += 1
            args = tf.args(rng, f["k"])
            if repr(args) in seen:
                continue
            differs = _run(good, f["name"], args) != _run(bad, f["name"], args)
            if f["buggy"] and not differs and quiet >= 1 and tries < 300:
                continue  # most cases of the buggy function should show the bug
            seen.add(repr(args))
            quiet += not differs
            cases.append((f["name"], args))
    hidden = [{"function": n, "args": list(a), "expected": _run(good, n, a)} for n, a in cases]
    assert not any(isinstance(c["expected"], str) and c["expected"].startswith("raised ") for c in hidden)
    exposing_cases = [c for c in hidden if c["function"] == bug["name"]
                      and _run(bad, c["function"], tuple(c["args"])) != c["expected"]]
    if len(exposing_cases) < 2:  # this draw cannot show the bug well: take the next seed's draw
        return make_task(seed + 104_729) | {"seed": seed}
    visible = exposing_cases[:1] + [c for c in hidden if c not in exposing_cases][:2]
    return {"seed": seed, "module": module, "function": bug["name"], "template": bug["template"],
            "source": header + bad_src, "fixed_source": header + good_src, "hidden": hidden,
            "visible": visible, "question": (
                f"The function {bug['name']} in {module}.py has a bug: some tests in test_{module}.py fail. "
                f"Fix {module}.py so that {bug['name']} is correct and the other functions still work, then "
                f"call submit.")}


def visible_test_file(task: dict) -> str:
    """``test_<module>.py``: the visible cases, runnable with ``python3 test_<module>.py``."""
    m = task["module"]
    cases = ",\n".join(f"    ({c['function']!r}, {tuple(c['args'])!r}, {c['expected']!r})" for c in task["visible"])
    return (f'"""Tests of {m}.py: python3 test_{m}.py"""\n\nimport {m}\n\nCASES = [\n{cases},\n]\n\n'
            "failed = 0\nfor name, args, want in CASES:\n    try:\n        got = getattr(" + m + ", name)(*args)\n"
            "        got = list(got) if isinstance(got, tuple) else got\n"
            "        ok = got == want or (isinstance(got, float) and isinstance(want, float) and abs(got - want) < 1e-6)\n"
            "    except Exception as err:\n        got, ok = f\"raised {type(err).__name__}: {err}\", False\n"
            "    print(\"PASS\" if ok else \"FAIL\", f\"{name}{args!r}\", \"\" if ok else f\"-> {got!r}, expected {want!r}\")\n"
            "    failed += not ok\nprint(f\"{len(CASES) - failed} passed, {failed} failed\")\n"
            "raise SystemExit(1 if failed else 0)\n")


@lru_cache(maxsize=2)
def code_repair_tasks(split: str) -> tuple:
    """The split's tasks (train and test from disjoint seed ranges)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    seeds = range(N_TRAIN) if split == "train" else range(_TEST_SEED0, _TEST_SEED0 + N_TEST)
    return tuple(make_task(s) for s in seeds)


def bug_catalogue() -> list[tuple[str, str]]:
    """Every (buggy snippet, fix) the templates plant, constants filled in (what the expert knows)."""
    out = []
    for t in TEMPLATES:
        for k in t.constants:
            out.append((t.bad.replace("{k}", str(k)), t.good.replace("{k}", str(k))))
    return out
