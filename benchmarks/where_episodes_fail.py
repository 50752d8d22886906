"""Where does a policy's episode go wrong? Two views of a saved retail policy against the oracle.

1. **Sampled:** ``--samples`` episodes of each chosen test task, played with the rollout settings of the
   tiny-cpu preset (``--temperature``, default 1, as its evaluations), and for each failed episode the
   first tool call that differs from the oracle's on the same task: a message where the oracle calls a
   tool, a call the environment cannot read (no closing tag, broken JSON), another tool (named), or a wrong
   value (which arguments). The scripted customer answers the same way to the same calls, so the first
   difference is where the episode left the oracle's path.
2. **Teacher-forced:** the oracle's episodes of the same tasks fed to the policy, and for every value of
   every tool-call argument the oracle writes, whether the policy's most likely token is right at the
   value's first token (which value) and at all of its other tokens (copying it through), by argument.
   ``copy`` values appeared earlier in the episode (the customer's sentence, a tool's record); ``new``
   ones did not (mostly tool names). The item ids the oracle names in its confirmation before an item
   call ("I will return the Bookshelf 2552978718 (cotton, modern) of order ...") are rows of their own
   (``items (message)``, ``new items (message)``): that is where the item the customer described is
   looked up in the order's record; the call after it copies the ids from the confirmation. Their origin
   says whether the id is the first item of the record it is read from (``first listed``) or another
   (``listed later``): a policy that has learned to copy the first item id, not to look the described one
   up, gets only the first.
   The payment method ids of the oracle's confirmations (``I will pay order #W6303495 with
   gift_card_2876511``) are rows too (``payment (message)``, scored from the id's first digits, where the
   method is picked): ``latest of its prefix`` when no other id with the same word before its digits
   (``card_``: a credit card's or a gift card's) stands after it earlier in the episode, ``another after
   it`` when one does (the card the order is paid with, in the order's record read after the customer's):
   a policy that copies the digits after the most recent ``card_`` gets only the first.

    python benchmarks/where_episodes_fail.py --policy data/retail-tiny-start                   # 120 x 4, ~5 min
    python benchmarks/where_episodes_fail.py --policy DIR --kinds "read only,cancel_pending_order"

A task fails when any one of its values is wrong, and a tiny policy that starts a value wrong often
loses the call's format with it, so the first view counts where episodes end up and the second says
which values the policy cannot look up at all.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

print = functools.partial(print, flush=True)


def oracle_calls(messages: list[dict]) -> list[tuple[str, dict]]:
    """The ``(name, arguments)`` of every tool call among the assistant turns of ``messages``."""
    from sinkflex_core.envs.base import parse_action

    calls = []
    for m in messages:
        if m["role"] != "assistant":
            continue
        for call in m.get("tool_calls") or []:  # the chat format's tool calls (the oracle's episodes)
            arguments = call["function"]["arguments"]
            calls.append((call["function"]["name"], json.loads(arguments) if isinstance(arguments, str) else arguments))
        action = parse_action(m.get("content") or "")
        if action.kind == "tool":  # a tool call written in the text (a policy's turns)
            calls.append((action.name, action.arguments))
    return calls


def _first_wrong_part(text: str, name: str, arguments: dict) -> str:
    """Which part of the oracle's call ``name(arguments)``, written as the policy writes calls
    (:func:`sinkflex_core.envs.base.format_tool_call`), ``text`` first differs in: ``"tool name"``,
    an argument's name, or ``"format"`` (the tags and JSON around them)."""
    from sinkflex_core.envs.base import format_tool_call

    ref = format_tool_call(name, arguments)
    at = next((i for i, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    parts = [(ref.index('"name": ') + len('"name": '), "tool name")]
    inner = ref.index('"arguments": ')
    parts += [(ref.index(f'"{key}": ', inner) + len(f'"{key}": '), key) for key in arguments]
    parts.append((ref.rindex("}}"), "format"))
    label = "format"
    for start, part in parts:
        if start <= at:
            label = part
    return label


def first_difference(messages: list[dict], oracle: list[tuple[str, dict]]) -> str:
    """Where the assistant turns of ``messages`` first leave the oracle's tool calls ``oracle``: a label
    such as ``call 1 (get_user_details): wrong user_id``. Messages to the customer between calls are
    skipped; a turn that tries a tool call and cannot be read counts as that call, labelled with the
    part of the oracle's call its text first differs in (``unreadable, off at email``)."""
    from sinkflex_core.envs.base import parse_action

    tries = []
    for m in messages:
        if m["role"] != "assistant":
            continue
        text = m.get("content") or ""
        for call in m.get("tool_calls") or []:  # a call the environment read (its text is not kept)
            arguments = call["function"]["arguments"]
            tries.append(("", call["function"]["name"],
                          json.loads(arguments) if isinstance(arguments, str) else arguments))
        if m.get("tool_calls"):
            continue
        action = parse_action(text)
        if action.kind == "tool":
            tries.append((text, action.name, action.arguments))
        elif action.kind == "invalid" or "<tool_call>" in text or '"arguments"' in text:
            tries.append((text, None, None))
    for i, (name, arguments) in enumerate(oracle):
        where = f"call {i} ({name})"
        if i >= len(tries):
            return f"{where}: never made"
        text, got, args = tries[i]
        if got is None:
            return f"{where}: unreadable, off at {_first_wrong_part(text, name, arguments)}"
        if got != name:
            return f"{where}: another tool ({got})"
        wrong = [k for k in arguments if args.get(k) != arguments[k]] + sorted(set(args) - set(arguments))
        if wrong:
            return f"{where}: wrong {','.join(wrong)}"
    return "every call right (answer, extra calls or the end)"


def sampled_failures(policy, tokenizer, tasks: list[int], samples: int, temperature: float = 1.0,
                     seed: int = 0, progress: bool = True) -> collections.Counter:
    """``samples`` episodes of each test task in ``tasks``, played by ``policy``: how many succeeded
    (``"success"``) and, for the others, how many left the oracle's path where (:func:`first_difference`)."""
    from tqdm.auto import tqdm

    from sinkflex_core.envs.oracle import expert_conversation
    from sinkflex_core.rollout import HFBackend, collect_rollouts
    from sinkflex_core.train.config import resolve_config, rollout_config
    from sinkflex_core.train.data import derive_seed

    cfg = resolve_config("tiny-cpu")
    oracle = {t: oracle_calls(expert_conversation(cfg.env_id, "test", t)[0]) for t in tasks}
    counts = collections.Counter()
    chunks = [tasks[i:i + 8] for i in range(0, len(tasks), 8)]
    with torch.no_grad():
        for n, chunk in enumerate(tqdm(chunks, desc="episodes", unit="call", disable=not progress)):
            call_seed = derive_seed(seed, "where_episodes_fail", n) & 0x7FFFFFFF
            torch.manual_seed(call_seed)
            batch = collect_rollouts(HFBackend(policy, tokenizer), tokenizer, cfg.env_id, chunk, "test",
                                     rollout_config(cfg, call_seed, group_size=samples, temperature=temperature))
            for traj in batch.trajectories:
                success = traj.reward >= 1 - 1e-6
                counts["success" if success else first_difference(traj.messages, oracle[traj.task_index])] += 1
    return counts


#: The item ids of the oracle's confirmations before an item call (``sinkflex_core.envs.oracle``): the
#: items kept or returned, then, for an exchange or a change of items, the items they become.
CONFIRMED_ITEMS = re.compile(r"I will (?:return|exchange|change) (the .+?)(?: for ([\d, ]+?))? (?:of|in) order")
#: An item id in a confirmation: ten digits (an old item's name comes before its id: ``the Tent 6948105125``).
ITEM_ID = re.compile(r"\b\d{10}\b")


def value_accuracy(model, tokenizer, examples: list[dict[str, torch.Tensor]]) -> list[dict]:
    """Teacher-forced accuracy on the values of the oracle's tool calls in ``examples`` (from
    :func:`sinkflex_core.sft.expert_examples`): one row per argument and origin (``copy``: the value's
    text appeared earlier in the episode; ``new``: it did not) with ``values``, ``first`` (share whose
    first token is the most likely one), ``rest`` (share whose other tokens all are, given the right
    ones before) and ``whole`` (both); the item ids of the oracle's confirmations (:data:`CONFIRMED_ITEMS`)
    as the arguments ``items (message)`` and ``new items (message)``, their origin ``first listed``,
    ``listed later`` or ``new`` (:func:`_confirmed_items`); their payment method ids as ``payment
    (message)`` (:func:`_confirmed_payments`)."""
    from sinkflex_core.sft_data import token_texts, value_start_mask, value_start_tokens

    texts = token_texts(tokenizer)
    tables = value_start_tokens(tokenizer)
    stats = collections.defaultdict(lambda: [0, 0, 0, 0])
    was_training = model.training
    model.eval()
    try:
        for e in examples:
            ids = e["input_ids"]
            with torch.no_grad():
                pred = model(input_ids=ids[None]).logits[0].argmax(-1)
            text, starts = text_and_starts(ids, texts)
            found = []  # (argument, origin, whether each token of the value was the most likely one)
            for start in value_start_mask(ids[None], e["loss_mask"][None], *tables)[0].nonzero().flatten().tolist():
                end = start  # the value runs up to the token that holds its closing quote
                while end < len(ids) and '"' not in texts[int(ids[end])]:
                    end += 1
                if end >= len(ids):
                    continue
                tail = texts[int(ids[end])].split('"')[0]
                span = range(start, end + 1 if tail else end)
                if not span:
                    continue
                value = text[starts[start]:starts[end]] + tail
                keys = re.findall(r'(\w+)":', text[starts[max(0, start - 16)]:starts[start]])
                origin = "copy" if value and value in text[:starts[start - 1]] else "new"
                found.append((keys[-1] if keys else "name", origin, [int(pred[p - 1]) == int(ids[p]) for p in span]))
            confirmed = list(_confirmed_items(ids, e["loss_mask"], pred, text, starts))
            confirmed += _confirmed_payments(ids, e["loss_mask"], pred, text, starts)
            for key, origin, hits in found + confirmed:
                row = stats[(key, origin)]
                row[0] += 1
                row[1] += hits[0]
                row[2] += all(hits[1:])
                row[3] += all(hits)
    finally:
        model.train(was_training)
    return [{"argument": key, "origin": origin, "values": n, "first": f / n, "rest": r / n, "whole": w / n}
            for (key, origin), (n, f, r, w) in sorted(stats.items())]


def text_and_starts(ids: torch.Tensor, texts: list[str]) -> tuple[str, list[int]]:
    """The text of the tokens ``ids`` (``texts``: :func:`sinkflex_core.sft_data.token_texts`) and each
    token's offset in it."""
    starts, text = [], []
    at = 0
    for t in ids.tolist():
        starts.append(at)
        text.append(texts[t])
        at += len(texts[t])
    return "".join(text), starts


def _confirmed_items(ids: torch.Tensor, loss_mask: torch.Tensor, pred: torch.Tensor, text: str, starts: list[int]):
    """Each item id of the oracle's confirmations in one episode (:data:`CONFIRMED_ITEMS`, the expert's
    tokens only): ``(argument, origin, hits)``, ``hits`` whether the most likely token was right at each of
    the id's tokens (a token that holds the id's first digit opens it). ``origin`` says where the id was
    read: ``first listed`` when it is the first item id of the last tool output that names it (an order's
    record, a product's variants), ``listed later`` when another item comes before it there (a policy
    that copies the record's first item id gets only the first), ``new`` when no tool output named it.
    ``text`` is the episode's text and ``starts`` each token's offset in it."""
    for match in CONFIRMED_ITEMS.finditer(text):
        for group, key in ((1, "items (message)"), (2, "new items (message)")):
            if match.group(group) is None:
                continue
            for found in ITEM_ID.finditer(match.group(group)):
                at, value = match.start(group) + found.start(), found.group()
                first = bisect.bisect_right(starts, at) - 1
                span = range(first, bisect.bisect_left(starts, at + len(value)))
                if first == 0 or not bool(loss_mask[first]):
                    continue
                yield key, _listed(text[:starts[first]], value), [int(pred[n - 1]) == int(ids[n]) for n in span]


#: A payment method's id (``credit_card_8562734``, ``gift_card_2876511``, ``paypal_4080120``).
PAYMENT_ID = re.compile(r"\b(?:credit_card|gift_card|paypal)_\d+")


def _confirmed_payments(ids: torch.Tensor, loss_mask: torch.Tensor, pred: torch.Tensor, text: str,
                        starts: list[int]):
    """Each payment method id the oracle names in a confirmation, as :func:`_confirmed_items`: ``("payment
    (message)", origin, hits)``, the hits from the id's first digits (where the method is picked; the words
    before them say its source, as the customer named it). ``origin`` (:func:`_latest_of_prefix`) says
    whether another id with the same tokens right before its digits stands after it in the text before."""
    from sinkflex_core.envs.customer import CONFIRM_MARK
    from sinkflex_core.models import IM_END, IM_START

    for found in PAYMENT_ID.finditer(text):
        value = found.group()
        turn = text.rfind(IM_START, 0, found.start())
        end = text.find(IM_END, found.end())
        if CONFIRM_MARK not in text[turn:end if end >= 0 else len(text)]:
            continue  # a call's argument (a row of ``payment_method_id``) or the report after the call
        at = found.start() + value.rindex("_") + 1  # the first digit
        first = bisect.bisect_right(starts, at) - 1
        if starts[first] != at or first == 0 or not bool(loss_mask[first]):
            continue
        span = range(first, bisect.bisect_left(starts, found.end()))
        yield "payment (message)", _latest_of_prefix(text[:found.start()], value), \
            [int(pred[n - 1]) == int(ids[n]) for n in span]


def _latest_of_prefix(before: str, value: str) -> str:
    """Where the payment method id ``value`` stands in ``before`` among the ids with the same last word
    before the digits (``card_`` for a credit card's and a gift card's, ``paypal_``): ``"latest of its
    prefix"`` when no other such id comes after its last mention (a copy of the digits after the most recent
    ``card_`` gets it right), ``"another after it"`` when one does (the order's record naming the card it
    is paid with, after the customer's record listing both), ``"new"`` when ``before`` never names it."""
    word = value.split("_")[-2]  # "card" of credit_card_8562734
    same = [m.group() for m in PAYMENT_ID.finditer(before) if m.group().split("_")[-2] == word]
    if value not in same:
        return "new"
    return "latest of its prefix" if same[-1] == value else "another after it"


def _listed(before: str, value: str) -> str:
    """Where the item id ``value`` stands in the last tool output of ``before`` that names it (see
    :func:`_confirmed_items`)."""
    for output in reversed(re.findall(r"<tool_response>(.*?)</tool_response>", before, re.S)):
        # an order's items are written {"Bookshelf": "<id>", ...}, a product's variants {"item_id": "<id>", ...}
        listed = re.findall(r'"(?:item_id|[A-Z][\w -]*)":\s*"(\d+)"', output)
        if value in listed:
            return "first listed" if listed[0] == value else "listed later"
    return "new"


def main(argv: list[str] | None = None) -> int:
    from sinkflex_core.provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="a saved policy folder")
    p.add_argument("--tasks", type=int, default=120, help="the first N test tasks")
    p.add_argument("--kinds", default="", help="only tasks of these kinds (comma-separated, as "
                   "sinkflex_core.train.task_kinds names them: 'read only', 'cancel_pending_order', ...)")
    p.add_argument("--samples", type=int, default=4, help="episodes per task (0: only the teacher-forced view)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    if not (Path(args.policy) / "config.json").is_file():
        p.error(f"--policy {args.policy!r} is not a saved policy folder (no config.json)")
    # nan passes "< 0"; it (or inf) reached the rollouts only after the policy and the oracle's episodes loaded
    if args.samples < 0 or args.tasks < 1 or not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--samples must be >= 0, --tasks >= 1 and --temperature a number >= 0 (got --temperature "
                f"{args.temperature})")
    if args.threads:
        torch.set_num_threads(args.threads)

    from sinkflex_core import models, sft
    from sinkflex_core.train import count_tasks, task_kinds

    if args.no_progress:
        models.hide_loading_bars()

    tasks = list(range(min(args.tasks, count_tasks("sinkflex/Retail-v0", "test"))))
    if args.kinds:
        wanted = {k.strip() for k in args.kinds.split(",")}
        kinds = task_kinds("test", tasks)
        unknown = wanted - set(kinds)
        if unknown:
            p.error(f"--kinds: no test task of kind {sorted(unknown)}; kinds here: {sorted(set(kinds))}")
        tasks = [t for t, k in zip(tasks, kinds) if k in wanted]
    policy = models.load_policy(args.policy)  # with the attention it was trained with
    tokenizer = models.load_tokenizer(args.policy)
    t0 = time.perf_counter()
    if args.samples:
        counts = sampled_failures(policy, tokenizer, tasks, args.samples, args.temperature, args.seed,
                                  progress=not args.no_progress)
        total = sum(counts.values())
        print(f"{len(tasks)} test tasks x {args.samples} episodes at temperature {args.temperature:g}: "
              f"{counts['success']} of {total} succeeded ({counts['success'] / total:.3f})")
        print("where the others first left the oracle's tool calls:")
        for label, n in counts.most_common():
            if label != "success":
                print(f"  {n:5d}  {label}")
    examples = sft.expert_examples(tokenizer, sft.SFTConfig(), tasks, split="test")
    rows = value_accuracy(policy, tokenizer, examples)
    print(f"teacher-forced, the oracle's episodes of the same {len(tasks)} tasks "
          "(first token / the rest / whole value right):")
    print(f"  {'argument':<20} {'origin':<20} {'values':>6} {'first':>6} {'rest':>6} {'whole':>6}")
    for r in rows:
        print(f"  {r['argument']:<20} {r['origin']:<20} {r['values']:>6} {r['first']:>6.2f} {r['rest']:>6.2f} "
              f"{r['whole']:>6.2f}")
    print(f"({(time.perf_counter() - t0) / 60:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
