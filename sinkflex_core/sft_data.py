"""The data of the SFT run: the oracle's episodes as token tensors (with their openings, renamed and
renumbered at random so that remembering the training users does not pay), batched by length, and the
drills mixed into them. The drills (copy, key-value recall, the identity lookup scored alone) exist
because a tiny model trained from scratch forms no induction circuit of its own and learns last to read
the values a tool call needs out of the conversation; :mod:`sinkflex_core.sft` trains on both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .paths import atomic_path, files_digest

if TYPE_CHECKING:
    from .sft import SFTConfig


def expert_examples(tokenizer, cfg: SFTConfig, task_indices: list[int], split: str = "train",
                    cache_dir: Path | None = None) -> list[dict[str, torch.Tensor]]:
    """One example per task the oracle solves: ``{"input_ids": (L,), "loss_mask": (L,)}`` long tensors,
    cut at ``max_total_tokens``. Cached under ``cache_dir`` (a key of the tokenizer, tasks, settings and
    :func:`worlds_digest`, so that a change to a world, its tasks or its oracle is never served from an
    older cache)."""
    from .rollout import AgentBackend, collect_rollouts

    key = hashlib.sha256(json.dumps({
        "vocab": sorted(tokenizer.get_vocab().items()), "template": tokenizer.chat_template, "env": cfg.env_id,
        "split": split, "tasks": task_indices, "system": cfg.system_prompt, "tools": cfg.include_tools,
        "turns": cfg.max_turns, "new": cfg.max_new_tokens_per_turn,
        "max_total": cfg.max_total_tokens, "worlds": worlds_digest()}, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"expert-{key}.pt" if cache_dir is not None else None
    if path is not None and path.is_file():
        return torch.load(path, weights_only=True)
    # The oracle's episodes are played without a length limit and cut afterwards, so that every
    # task contributes (its first max_total_tokens tokens).
    rcfg = dataclasses.replace(cfg.rollout_config(), max_total_tokens=1 << 20, max_new_tokens_per_turn=4096,
                               max_turns=max(cfg.max_turns, 64))
    out = []
    bar = None
    if cfg.progress and len(task_indices) > 200:
        from tqdm import tqdm

        bar = tqdm(total=len(task_indices), desc=f"expert episodes ({split})", unit="task", dynamic_ncols=True,
                   file=sys.stderr)
    try:
        for i in range(0, len(task_indices), 50):
            chunk = task_indices[i:i + 50]
            batch = collect_rollouts(AgentBackend(tokenizer), tokenizer, cfg.env_id, chunk, split, rcfg)
            for row in range(len(batch)):
                if float(batch.rewards[row]) < 1.0:  # keep only episodes the oracle solved
                    continue
                n = min(int(batch.attention_mask[row].sum()), cfg.max_total_tokens)
                out.append({"input_ids": batch.input_ids[row, :n].clone(),
                            "loss_mask": batch.loss_mask[row, :n].clone()})
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            torch.save(out, tmp)
    return out


def worlds_digest(folder: Path | None = None) -> str:
    """A digest of the worlds' code (every ``.py`` file of ``sinkflex_core/envs``, or of ``folder``): the
    tasks, the customers and the oracles whose episodes :func:`expert_examples` caches."""
    return files_digest(Path(__file__).parent / "envs" if folder is None else folder, {".py"})[:16]


def episode_openings(examples: list[dict[str, torch.Tensor]], tool_call_id: int) -> list[dict[str, torch.Tensor]]:
    """Each example cut after the expert's first turn that calls a tool (the turn with ``tool_call_id``,
    through its end-of-turn token); examples without such a turn are skipped.

    In the retail world that first call is the identity lookup: the e-mail, or the name and zip code,
    read out of the customer's sentence, which a tiny model learns last. An opening is about a fifth
    of an episode's tokens, so repeating the openings (``SFTConfig.opening_copies``) adds many such
    lookups per optimizer step for few tokens; renamed and renumbered afresh each time they are drawn
    (:func:`swap_names`), the copies are different lookups."""
    out = []
    for e in examples:
        ids, mask = e["input_ids"], e["loss_mask"].bool()
        calls = ((ids == tool_call_id) & mask).nonzero().flatten()
        if not len(calls):
            continue
        after = (~mask[int(calls[0]):]).nonzero().flatten()  # the first non-expert token after the call
        end = int(calls[0]) + int(after[0]) if len(after) else len(ids)
        out.append({"input_ids": ids[:end].clone(), "loss_mask": e["loss_mask"][:end].clone()})
    return out


def identity_batch(openings: list[dict[str, torch.Tensor]], rows: int, rng: np.random.Generator, pad_id: int,
                   value_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   groups: list[torch.Tensor] | None = None,
                   quotes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``rows`` episode openings (:func:`episode_openings`) drawn at random, renamed with ``groups``
    (:func:`swap_names`; none: as they are), as a batch in the layout of :func:`collate` whose loss
    mask keeps only the first token of each value the expert writes in the opening's tool call
    (:func:`value_start_mask`, tables from :func:`value_start_tokens`): the tool's name and the
    identity lookup's e-mail, or first name, last name and zip code, read out of the customer's
    sentence. With ``quotes`` (:func:`quote_tokens`), every token of each value is scored, up to the one
    that holds its closing quote (:func:`whole_values`): the zip code's last two digits too, which
    follow its first three by plain induction. All rows are marked in ``copy_rows``, so
    :func:`~sinkflex_core.sft.sft_loss` scores only those tokens and averages over them.

    A full episode has a few such tokens among about a thousand, and the tiny model learns the
    conversation's form and copying from records long before it reads the customer's sentence; scored
    alone, with a loss of their own, these lookups are learned in a few hundred steps (see :mod:`sinkflex_core.sft`)."""
    if not openings:
        raise ValueError("identity_batch needs at least one episode opening")
    picked = [openings[int(i)] for i in rng.integers(0, len(openings), rows)]
    return _value_rows(picked, rng, pad_id, value_tables, groups, quotes)


def _value_rows(picked: list[dict[str, torch.Tensor]], rng: np.random.Generator, pad_id: int,
                value_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], groups: list[torch.Tensor] | None,
                quotes: torch.Tensor | None, whole: list[bool] | None = None) -> dict[str, torch.Tensor]:
    if groups:
        picked = [swap_names(e, groups, rng) for e in picked]
    rows = len(picked)
    batch = collate(picked, pad_id)
    starts = value_start_mask(batch["input_ids"], batch["loss_mask"], *value_tables)
    if quotes is not None:
        starts = whole_values(batch["input_ids"], starts, quotes) & batch["loss_mask"].bool()
    if whole is not None and any(whole):  # these rows score every expert token they hold
        keep = torch.tensor(whole)
        starts[keep] = batch["loss_mask"][keep].bool()
    batch["loss_mask"] = starts.to(batch["loss_mask"].dtype)
    batch["copy_rows"] = torch.ones(rows, dtype=torch.bool)
    return batch


def action_cuts(examples: list[dict[str, torch.Tensor]], tool_call_id: int, messages: bool = False
                ) -> list[tuple[int, int, int, bool]]:
    """Every expert turn that calls a tool, but each episode's first (the identity lookup, which
    :func:`episode_openings` serves): ``(example, start, end, whole)``, the turn's span of expert
    tokens, for :func:`action_batch`. The lookups of the later calls (an order's item ids, a new address,
    the payment method the customer named, the tool the request asks for) are a few tokens among a
    thousand, as the identity lookup's were.

    ``messages`` adds the expert's messages (turns without a tool call) that come after the episode's
    first tool call and before its last: in the retail world, the confirmation that names the values of
    the write call after it (the new address, the items and the items they become), looked up in the
    customer's sentence and the records. Those cuts have ``whole`` set: every token of the message is
    scored, not just the first tokens of a call's values."""
    out = []
    for n, e in enumerate(examples):
        mask = e["loss_mask"].bool()
        ids = e["input_ids"]
        # the expert's turns: runs of scored tokens
        edges = torch.diff(mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                           append=torch.zeros(1, dtype=torch.int8))
        starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
        call_at = set(((ids == tool_call_id) & mask).nonzero().flatten().tolist())
        spans = [(a, b, any(a <= c < b for c in call_at)) for a, b in zip(starts, ends)]
        calls = [k for k, (_, _, call) in enumerate(spans) if call]
        if not calls:
            continue
        for k, (start, end, call) in enumerate(spans):
            if call and k != calls[0]:
                out.append((n, start, end, False))
            elif messages and not call and calls[0] < k < calls[-1]:
                out.append((n, start, end, True))
    return out


def call_name(ids: torch.Tensor, texts: list[str]) -> str | None:
    """The tool name of the call that the tokens ``ids`` (an expert turn) write, or None. Read with a
    pattern rather than :func:`sinkflex_core.envs.base.parse_action`: an episode cut at
    ``max_total_tokens`` inside a call (50 of the 10,000 synthetic ones) ends in no complete call, yet its
    tool's name and first values are there to score."""
    found = re.search(r'"name":\s*"([^"]+)"', "".join(texts[int(t)] for t in ids))
    return found.group(1) if found else None


def action_batch(examples: list[dict[str, torch.Tensor]], cuts: list[tuple[int, int, int, bool]], rows: int,
                 rng: np.random.Generator, pad_id: int, value_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 groups: list[torch.Tensor] | None = None, quotes: torch.Tensor | None = None,
                 short: tuple[list[str], int] | None = None) -> dict[str, torch.Tensor]:
    """As :func:`identity_batch`, for the later turns: ``rows`` of ``cuts`` (:func:`action_cuts`)
    drawn at random, each episode cut after that turn, with only the values of that turn's call scored
    (their first tokens; with ``quotes``, whole), or every token of it for a cut marked ``whole`` (a
    message). With ``short`` (``(texts, turn_id)``, :func:`short_context`'s), each row keeps only the
    turns that hold what the cut turn reads."""
    if not cuts:
        raise ValueError("action_batch needs at least one tool call after the first")
    picked, whole = [], []
    for k in rng.integers(0, len(cuts), rows):
        n, start, end, all_tokens = cuts[int(k)]
        if short is not None:
            picked.append(short_context(examples[n], start, end, *short))
        else:
            mask = torch.zeros(end, dtype=examples[n]["loss_mask"].dtype)
            mask[start:end] = examples[n]["loss_mask"][start:end]
            picked.append({"input_ids": examples[n]["input_ids"][:end], "loss_mask": mask})
        whole.append(all_tokens)
    return _value_rows(picked, rng, pad_id, value_tables, groups, quotes, whole)


def short_context(example: dict[str, torch.Tensor], start: int, end: int, texts: list[str], turn_id: int
                  ) -> dict[str, torch.Tensor]:
    """The episode ``example`` up to the expert turn ``[start, end)`` (an action cut, :func:`action_cuts`)
    with its middle cut away: the system turn, the customer's sentences, the expert's messages, the tool
    outputs that hold a value of the call the turn makes or, for a message, of the next call (a value with
    a digit: an order, item or product id, a payment method, a street address), and the turn itself,
    scored as in the whole episode. The other tool outputs and the expert's other calls go.

    ``texts`` is :func:`token_texts`; ``turn_id`` the id that opens a chat turn (``<|im_start|>``). A
    request a few hundred tokens back in the whole episode is a few dozen back here: the tiny model learns
    to read which value the customer named (the payment method, a dictated street, the item) in such rows
    and carries part of it over to whole episodes (``docs/experiments.md``)."""
    ids, mask = example["input_ids"], example["loss_mask"]
    bounds = (ids == turn_id).nonzero().flatten().tolist()
    if not bounds or bounds[0] != 0:
        bounds = [0] + bounds
    turns = list(zip(bounds, bounds[1:] + [len(ids)]))
    text = [("".join(texts[int(t)] for t in ids[a:b])) for a, b in turns]
    is_call = [t.startswith(texts[turn_id] + "assistant") and "<tool_call>" in t[:40] for t in text]
    target = next(k for k, (a, b) in enumerate(turns) if a <= start < b)
    # the call whose values decide which tool outputs stay: the turn's own, else the next one
    call = next((k for k in range(target, len(turns)) if is_call[k]), target)
    values = {v for v in re.findall(r'"([^"]+)"', text[call].split('"arguments"', 1)[-1]) if re.search(r"\d", v)}
    keep = []
    for k, (a, b) in enumerate(turns[:target]):
        if "<tool_response>" in text[k][:40]:
            if any(v in text[k] for v in values):
                keep.append((a, b))
        elif not is_call[k]:
            keep.append((a, b))
    a = turns[target][0]
    new_ids = torch.cat([ids[x:y] for x, y in keep] + [ids[a:end]])
    new_mask = torch.zeros(len(new_ids), dtype=mask.dtype)
    new_mask[len(new_ids) - (end - start):] = mask[start:end]
    return {"input_ids": new_ids, "loss_mask": new_mask}


def quote_tokens(tokenizer) -> torch.Tensor:
    """A boolean table over the vocabulary: the tokens whose text holds a double quote (the end of a
    JSON string value, for :func:`whole_values`)."""
    return torch.tensor(['"' in t for t in token_texts(tokenizer)], dtype=torch.bool)


def whole_values(input_ids: torch.Tensor, starts: torch.Tensor, quotes: torch.Tensor) -> torch.Tensor:
    """``starts`` (the first token of each value, :func:`value_start_mask`) widened to the whole value:
    each start and the tokens after it up to, not including, the first that holds a double quote
    (``quotes``, :func:`quote_tokens`). Boolean, the shape of ``input_ids``."""
    is_quote = quotes[input_ids.clamp(0, len(quotes) - 1)]
    inside = starts.clone()
    for col in range(1, input_ids.shape[-1]):  # openings are short: a loop over the columns is cheap
        inside[..., col] = (inside[..., col - 1] & ~is_quote[..., col]) | starts[..., col]
    return inside


def length_batches(lengths: list[int], batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Indices grouped into batches of similar length whose padded size (rows x longest) stays within
    ``batch_tokens``; examples are sorted by length (those of equal length in random order), so an
    epoch's batches change little from one epoch to the next, and the batch order is random."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, longest = [], [], 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if cur and new_longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(examples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (B, L) ``input_ids``, ``attention_mask``, ``loss_mask``, ``position_ids``."""
    L = max(len(e["input_ids"]) for e in examples)
    B = len(examples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.float32)
    pos = torch.zeros((B, L), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n], att[i, :n], mask[i, :n], pos[i, :n] = e["input_ids"], 1, e["loss_mask"].float(), torch.arange(n)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask, "position_ids": pos}


def token_texts(tokenizer) -> list[str]:
    """The text of every id of ``tokenizer``'s vocabulary, each decoded alone."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))])


def value_start_tokens(tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three boolean tables over the vocabulary for :func:`value_start_mask`: tokens that open a JSON
    string value (``"``, `` "``, ``["``, `` "#``), those of them that end in ``#`` (an order id, whose
    ``W`` is the same in every id), and tokens that end a key (``":``)."""
    texts = token_texts(tokenizer)
    opens, hashes, keys = (torch.zeros(len(texts), dtype=torch.bool) for _ in range(3))
    for i, text in enumerate(texts):
        text = text.strip()
        opens[i] = text in ('"', '["', '"#', '["#')
        hashes[i] = opens[i] and text.endswith("#")
        keys[i] = text.endswith(":")
    return opens, hashes, keys


def value_start_mask(input_ids: torch.Tensor, loss_mask: torch.Tensor, opens: torch.Tensor,
                     hashes: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Where the expert writes the first token of an argument's value in a tool call (``"zip": "``
    -> the ``921`` of ``92181``; for an order id ``"#W``, the first digits): the token that says
    *which* value the agent copies from the conversation (a name or zip code the customer typed, an
    id from a record), or which tool it calls. Boolean, the shape of ``input_ids``; tables from
    :func:`value_start_tokens`.

    These are about 5 % of the expert's tokens (708 of 15,316 on the oracle's episodes of 60 test
    tasks) and the hardest ones (a lookup in the context); the conversation's form is learned long
    before them, so ``SFTConfig.value_loss_weight`` can weigh them more."""
    ids = input_ids.clamp(0, len(opens) - 1)
    out = torch.zeros_like(input_ids, dtype=torch.bool)
    n = input_ids.shape[-1]
    if n >= 3:  # key, opener, value
        out[..., 2:] = keys[ids[..., :-2]] & opens[ids[..., 1:-1]] & ~hashes[ids[..., 1:-1]]
    if n >= 4:  # key, opener ending in '#', the constant letter, value
        out[..., 3:] |= keys[ids[..., :-3]] & hashes[ids[..., 1:-2]]
    return out & loss_mask.bool()


def copy_drills(rows: int, length: int, token_ids: torch.Tensor, rng: np.random.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` copy drills of ``length`` tokens: a random segment of ``token_ids`` (8 tokens to half
    the row) repeated to the row's length. Returns ``(input_ids, loss_mask)``, the mask set on the
    repeats only, which nothing but copying from the context can predict."""
    ids = torch.empty((rows, length), dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.float32)
    for r in range(rows):
        m = int(rng.integers(8, max(9, length // 2) + 1))
        segment = token_ids[torch.from_numpy(rng.integers(0, len(token_ids), m))]
        ids[r] = segment.repeat(-(-length // m))[:length]
        mask[r, m:] = 1
    return ids, mask


def copy_drill_batch(rows: int, length: int, token_ids: torch.Tensor, rng: np.random.Generator
                     ) -> dict[str, torch.Tensor]:
    """A batch of :func:`copy_drills` in the layout of :func:`collate` (all rows marked as drills)."""
    return drill_batch(*copy_drills(rows, length, token_ids, rng))


def drill_batch(ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Drill rows ``ids`` / ``mask`` as a batch in the layout of :func:`collate`, all marked in
    ``copy_rows`` (:func:`~sinkflex_core.sft.sft_loss` scores only their masked tokens)."""
    rows, length = ids.shape
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
            "position_ids": torch.arange(length).expand(rows, length), "copy_rows": torch.ones(rows, dtype=torch.bool)}


def drill_row_count(rows: int, fraction: float) -> int:
    """How many drill rows make about ``fraction`` of a batch of ``rows`` expert rows plus them (at least one)."""
    return max(1, round(rows * fraction / (1 - fraction)))


def add_copy_rows(batch: dict[str, torch.Tensor], fraction: float, token_ids: torch.Tensor,
                  rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """``batch`` with :func:`copy_drills` appended, as long as its rows, about ``fraction`` of all
    rows (at least one).

    A pretrained LLM arrives with induction heads (attend to what followed the previous occurrence
    of the current tokens, copy it); a tiny model trained from scratch on a few thousand
    conversations does not form them, and then cannot continue an id it has started to copy. Drills
    are the classic way to make them form; from random weights they need many steps to leave the
    loss plateau (see :func:`sinkflex_core.models.init_previous_token_heads`)."""
    B, L = batch["input_ids"].shape
    return add_drill_rows(batch, *copy_drills(drill_row_count(B, fraction), L, token_ids, rng))


def add_drill_rows(batch: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``batch`` with drill rows ``ids`` / ``mask`` (as long as its rows) appended and marked in
    ``copy_rows``, where :func:`~sinkflex_core.sft.sft_loss` scores only their masked tokens."""
    extra = drill_batch(ids, mask.to(batch["loss_mask"].dtype))
    before = batch.get("copy_rows", torch.zeros(len(batch["input_ids"]), dtype=torch.bool))
    return {k: torch.cat([before if k == "copy_rows" else batch[k], v]) for k, v in extra.items()}


RECALL_FILLER_WORDS = ("is", "am", "are", "to", "of", "my", "the", "at", "in", "for")


def recall_tokens(tokenizer, examples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of :func:`recall_drills`: ``(token_ids, fillers)``, every token that occurs in
    ``examples`` but pad and end-of-text (``all_special_ids`` names only those two here: the chat's
    ``<|im_start|>`` and tool tags are drawn too), and those of them that may stand between a key and its value: tokens
    without a letter or digit (a space, quotes, ``":``, a comma) and a few short words (``is``, ``am``...)."""
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    seen = torch.unique(torch.cat([e["input_ids"] for e in examples]))
    seen = seen[~torch.isin(seen, special)]
    texts = token_texts(tokenizer)
    filler = torch.tensor([bool(texts[i]) and (not any(c.isalnum() for c in texts[i])
                                               or texts[i].strip() in RECALL_FILLER_WORDS) for i in seen.tolist()])
    return seen, seen[filler]


def recall_drills(rows: int, length: int, token_ids: torch.Tensor, fillers: torch.Tensor,
                  rng: np.random.Generator, fact_fillers: tuple[int, int] = (1, 1),
                  ask_fillers: tuple[int, int] = (1, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` key-value recall drills of ``length`` tokens. A block states 2-6 facts ``key SEP
    value`` (a key token, ``fact_fillers`` (min, max) of the ``fillers``, a value of 1-3 other tokens)
    among random tokens, then asks each key again after other fillers (``ask_fillers``), ``key SEP'
    value``; only those values are scored. Blocks follow one another to the row's length (random
    tokens in front), each with its own keys.

    This is the lookup of the retail world's identity call: the customer writes ``zip 92181``, a record
    ``"zip":"92181"`` (one token between key and value), the call needs ``"zip": "92181"`` (two). The
    token just before the value differs, so plain induction (match the current token,
    :func:`copy_drills`) does not find it: the model must match the key two tokens back, which the
    default layout drills. The e-mail (``email is lucia...``: three tokens) needs ``fact_fillers=(1, 3)``.
    With no fillers at all (``fact_fillers=ask_fillers=(0, 0)``) a drill is plain induction from one
    token, ``key value`` asked again after a different token: the zip code's last two digits after its
    first three, which the copy drills (whole rows repeated, a long match) do not teach.
    Returns ``(input_ids, loss_mask)``."""
    ids = torch.empty((rows, length), dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.float32)
    key_ids = token_ids[~torch.isin(token_ids, fillers)]

    def draw(pool: torch.Tensor, k: int, avoid: torch.Tensor) -> list[int]:
        t = pool[torch.from_numpy(rng.integers(0, len(pool), k))]
        return t[~torch.isin(t, avoid)].tolist()

    for r in range(rows):
        body: list[int] = []
        score: list[bool] = []
        used = torch.empty(0, dtype=torch.long)
        tries = 0
        while True:
            n = int(rng.integers(2, 7))
            fresh = key_ids[~torch.isin(key_ids, used)]  # a key of an earlier block would be asked with two values
            keys = fresh[torch.from_numpy(rng.choice(len(fresh), min(n, len(fresh)), replace=False))]
            avoid = torch.cat([used, keys])
            values = []
            while len(values) < len(keys):  # values: 1-3 tokens that are neither fillers nor keys
                values += [v] if (v := draw(key_ids, int(rng.integers(1, 4)), avoid)) else []
            b_ids: list[int] = []
            b_score: list[bool] = []
            for j, scored in [(int(j), False) for j in rng.permutation(len(keys))] + \
                             [(int(j), True) for j in rng.permutation(len(keys))]:
                b_ids += draw(token_ids, int(rng.integers(0, 7 if scored else 13)), avoid) + [int(keys[j])]
                lo, hi = ask_fillers if scored else fact_fillers
                b_ids += fillers[torch.from_numpy(rng.integers(0, len(fillers), int(rng.integers(lo, hi + 1))))].tolist()
                b_score += [False] * (len(b_ids) - len(b_score)) + [scored] * len(values[j])
                b_ids += values[j]
            if len(body) + len(b_ids) > length:
                tries += 1
                if body or tries >= 20:  # the row is full (a short row: try smaller blocks first)
                    break
                continue
            body += b_ids
            score += b_score
            used = avoid
        head = draw(token_ids, 2 * (length - len(body)) + 8, used)[:length - len(body)]
        head += [int(fillers[0])] * (length - len(body) - len(head))
        ids[r] = torch.tensor(head + body, dtype=torch.long)
        mask[r, len(head):] = torch.tensor(score, dtype=torch.float32)
    return ids, mask


def name_swap_groups(tokenizer, examples: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Groups of token ids that :func:`swap_names` permutes among themselves: the retail world's
    first names, last names, street names and one-word cities, each a ``(k, forms)`` long tensor
    (capitalised, and lowercase for the names that also appear in e-mails and user ids).

    A word is kept only where renaming it cannot change any other text: it is one token in every
    form, belongs to one group, is not a word of the catalogue (``green`` is a last name and a
    colour), and in ``examples`` is never glued to other letters."""
    from .envs import retail_world as world

    text = token_texts(tokenizer)
    letter_start = torch.tensor([bool(t) and t[0].isalpha() for t in text])
    letter_end = torch.tensor([bool(t) and t[-1].isalpha() for t in text])
    other_words = {w.lower() for values in world.OPTION_VALUES.values() for w in values}
    for name, *_ in world.PRODUCTS:
        other_words.update(w.lower() for w in name.replace("-", " ").split())
    candidates = [
        [(w.capitalize(), w) for w in world.FIRST_NAMES],
        [(w.capitalize(), w) for w in world.LAST_NAMES],
        [(w,) for w in world.STREETS],
        [(city,) for city, _ in world.CITIES if " " not in city],
    ]
    seen: dict[str, int] = {}
    for group in candidates:
        for forms in group:
            for f in forms:
                seen[f] = seen.get(f, 0) + 1
    glued: set[int] = set()
    if examples:
        ids = torch.cat([e["input_ids"] for e in examples[:2000]])
        glued_here = torch.zeros_like(ids, dtype=torch.bool)
        glued_here[1:] |= letter_end[ids[:-1]]
        glued_here[:-1] |= letter_start[ids[1:]]
        glued = set(ids[glued_here].tolist())
    groups = []
    for group in candidates:
        rows = []
        for forms in group:
            encoded = [tokenizer.encode(f, add_special_tokens=False) for f in forms]
            tok_ids = [e[0] if len(e) == 1 else None for e in encoded]
            if any(t is None or t in glued for t in tok_ids) or any(seen[f] > 1 for f in forms) \
                    or forms[-1].lower() in other_words:
                continue
            rows.append(tok_ids)
        if len(rows) >= 2:
            groups.append(torch.tensor(rows, dtype=torch.long))
    return groups


def number_swap_group(tokenizer) -> torch.Tensor:
    """The tokens of exactly three digits, as one :func:`swap_names` group (``(k, 1)``).

    The tokenizer splits digit runs into groups of three from the left
    (:func:`sinkflex_core.models.train_tokenizer`), so the first token of every id, zip code, street
    number and price of 100 or more is one of these. Permuting them, the same way everywhere in an
    episode, renumbers every such value consistently (the zip the customer types, the one in the call
    and the one in the record stay equal; an order id stays the same id wherever it appears), while
    the length of each number, its shorter groups, and prices' cents stay as they were. Without it,
    the training users' orders are a key a tiny model can use to remember their zip codes, e-mails and
    items instead of reading them from the conversation."""
    ids = [i for i, t in enumerate(token_texts(tokenizer)) if len(t) == 3 and t.isdigit()]
    return torch.tensor(ids, dtype=torch.long).reshape(-1, 1)


def digit_pair_group(tokenizer) -> torch.Tensor:
    """The tokens of exactly two digits, as one :func:`swap_names` group (``(k, 1)``): the last group of
    a zip code (``921`` ``81``), of cents and of some ids. :func:`number_swap_group` leaves them as they
    were, so that without this group a training user's zip code keeps its last two digits, a key to
    remembering them instead of copying them from the customer's sentence."""
    ids = [i for i, t in enumerate(token_texts(tokenizer)) if len(t) == 2 and t.isdigit()]
    return torch.tensor(ids, dtype=torch.long).reshape(-1, 1)


def swap_names(example: dict[str, torch.Tensor], groups: list[torch.Tensor], rng: np.random.Generator
               ) -> dict[str, torch.Tensor]:
    """``example`` with the words of each of :func:`name_swap_groups`' groups permuted at random, the
    same way everywhere in the episode (the customer's sentence, the tool calls, the records, the
    e-mail and the user id), so the episode stays consistent.

    The training users are few (the synthetic tasks reuse them), so a tiny model can lower its loss
    by remembering who has which zip code, e-mail and orders instead of reading them from the
    conversation, and then fails on the test users. Renamed episodes make remembering useless."""
    ids = example["input_ids"]
    table = torch.arange(max([int(ids.max())] + [int(g.max()) for g in groups]) + 1)
    for g in groups:
        table[g] = g[torch.from_numpy(rng.permutation(len(g)))]
    return {**example, "input_ids": table[ids]}
