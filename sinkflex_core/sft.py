"""Supervised fine-tuning of the tiny policy on the oracle agent's trajectories, stopped early: the
start policy of GRPO.

    python -m sinkflex_core.sft --out-dir runs/sft --stop-at-reward 0.25
    python -m sinkflex_core.sft --help                    # every option, with its default

The recipe, in the order :func:`train_sft` runs it:

- expert data: episodes of :class:`sinkflex_core.envs.OracleAgent` on the retail world's 10,000
  synthetic tasks (``expert_split``), played through :class:`sinkflex_core.rollout.AgentBackend`, so
  they are assembled token by token exactly as a policy rollout is; people and places renamed at
  random (``swap_names``) so that remembering the training users does not pay;
- a new model starts with previous-token heads (``previous_token_heads``) and learns to copy on drills
  alone (``copy_warmup_steps``), because a tiny model trained from scratch has no induction circuit;
- the loss: mean negative log-likelihood of the expert's tokens plus, weighted by
  ``context_loss_weight``, of every other token of the episode (customer messages and tool outputs,
  which repeat ids seen earlier: the cheapest teacher of copying); ``copy_fraction`` of each batch's
  rows stay copy drills;
- optional stages, off by default: key-value recall drills (``recall_*``), a heavier loss on the
  first token of tool-call values (``value_loss_weight``), the identity stage that scores the values
  of the identity call alone (``identity_*``; :data:`IDENTITY_STAGE` is the recorded second stage);
- early stopping: every ``eval_every`` optimizer steps the policy plays held-out training tasks (the
  last ``val_tasks`` of the ``"train"`` split, never in the SFT data) with the rollout settings of the
  GRPO run; training stops at the first evaluation whose mean reward reaches ``stop_at_reward`` (the
  paper's starting point is 0.25), or at ``max_steps`` / ``max_minutes``, keeping the best weights.

What each choice changed, and what was tried and dropped, with the commands and figures:
``docs/experiments.md``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .models import DEFAULT_VOCAB_SIZE
from .train import (
    COMPACT_SYSTEM_PROMPT,
    ConfigError,
    TokenLogprobs,
    add_config_arguments,
    option,
    parse_field,
)


@dataclass
class SFTConfig:
    """Model shape, expert data, optimisation and early stopping of the SFT run."""

    seed: int = option(0, "seed of the initial weights, the data order and the evaluations")
    env_id: str = option("sinkflex/Retail-v0", "the Gymnasium environment")
    vocab_size: int = option(DEFAULT_VOCAB_SIZE, "tokenizer vocabulary")
    hidden_size: int = option(128, "hidden size of the new model")
    num_layers: int = option(4, "decoder layers of the new model")
    num_heads: int = option(4, "head dimension 32; 0: hidden_size // 64 (models.tiny_qwen2_config's rule)")
    num_kv_heads: int = option(2, "0: half the heads")
    init_from: str = option("", "a saved policy folder (an earlier SFT run) to continue training; its shape "
                                "and tokenizer replace the four fields above")
    # -- the prompt and episode limits (use the GRPO run's values) --
    system_prompt: str | None = option(COMPACT_SYSTEM_PROMPT, "None: the environment's policy text")
    include_tools: bool = option(False, "tool schemas in the system turn")
    max_turns: int = option(16, "most assistant turns per episode")
    max_total_tokens: int = option(2048, "longer expert trajectories are cut here (the rollout would end "
                                         "there)")
    max_new_tokens_per_turn: int = option(128, "most tokens of one assistant turn")
    # -- data --
    expert_split: str = option("synthetic", "where the expert episodes come from: 'synthetic' (10,000 tasks) "
                                            "or 'train'")
    train_tasks: int = option(0, "expert episodes from the first N tasks of expert_split (0: all; for "
                                 "'train', all but the validation ones)")
    val_tasks: int = option(40, "the last N tasks of the 'train' split: never in the SFT data, for early "
                                "stopping")
    # -- optimisation --
    batch_tokens: int = option(4096, "padded tokens per optimizer step")
    lr: float = option(2e-3, "peak AdamW learning rate")
    context_loss_weight: float = option(1.0, "weight of the loss on non-expert tokens (0: classic SFT)")
    value_loss_weight: float = option(1.0, "weight of the first token of each tool-call argument value "
                                           "(value_start_mask)")
    copy_fraction: float = option(0.1, "share of each batch's rows that are copy drills (add_copy_rows); 0: "
                                       "none")
    recall_fraction: float = option(0.0, "about this share of each batch's rows are key-value recall drills "
                                         "(recall_drills)")
    swap_names: float = option(1.0, "share of the expert episodes whose people and places are renamed "
                                    "(swap_names)")
    opening_copies: int = option(0, "extra rows per episode of its opening, up to its first tool call "
                                    "(episode_openings)")
    swap_numbers: float = option(0.0, "share of the expert episodes whose numbers are renumbered "
                                      "(number_swap_group)")
    identity_rows: int = option(0, "episode openings per optimizer step whose identity-call values add their "
                                   "own mean loss to the step's (identity_batch)")
    # the next three apply to a new model only (skipped with init_from)
    previous_token_heads: bool = option(True, "start layer 0's first KV group as previous-token heads "
                                              "(models.init_previous_token_heads)")
    copy_warmup_steps: int = option(800, "optimizer steps on copy drills alone (batch_tokens each) before "
                                         "the SFT")
    copy_warmup_length: int = option(128, "tokens per drill row in that warm-up (and in the recall warm-up)")
    recall_warmup_steps: int = option(0, "optimizer steps on recall drills alone (recall_drills) before the "
                                         "SFT; also with init_from")
    identity_warmup_steps: int = option(0, "optimizer steps on identity_batch alone (about batch_tokens "
                                           "each) before the SFT; also with init_from")
    recall_fact_fillers: int = option(1, "most separator tokens between a drill fact's key and value (1: "
                                         "`zip 92181`; 3: also `email is lucia...`)")
    min_lr_ratio: float = option(0.1, "end of the cosine decay, as a share of lr")
    warmup_steps: int = option(30, "optimizer steps of linear warm-up")
    weight_decay: float = option(0.01, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient-norm clip")
    max_steps: int = option(3000, "optimizer steps at most")
    max_minutes: float = option(40.0, "minutes at most (> 0)")
    schedule_steps: int = option(0, "length of the cosine decay (0: max_steps)")
    # -- early stopping --
    eval_every: int = option(500, "optimizer steps between evaluations")
    eval_samples: int = option(1, "episodes per validation task")
    eval_temperature: float = option(1.0, "sampling temperature of the evaluations")
    stop_at_reward: float = option(0.25, "<= 0: never stop early")
    min_steps: int = option(0, "no early stop before this step")
    save_snapshots: bool = option(False, "also save the model at every evaluation (out_dir/snapshots/step_N)")
    keep_best: bool = option(True, "save the weights of the best evaluation (ties: the later), not the last")
    threads: int = option(0, "torch intra-op threads; 0 = torch's default")
    progress: bool = option(True, "a progress bar on stderr")
    out_dir: str = option("runs/sft", "where the policy, its tokenizer and the history go")

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "max_turns", "max_total_tokens", "copy_warmup_length",
                     "max_new_tokens_per_turn", "batch_tokens", "max_steps", "eval_every", "eval_samples"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("train_tasks", "val_tasks", "warmup_steps", "min_steps", "threads", "schedule_steps",
                     "num_heads", "num_kv_heads", "copy_warmup_steps", "opening_copies",
                     "recall_warmup_steps", "identity_warmup_steps", "identity_rows"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                raise ConfigError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (self.context_loss_weight >= 0 and math.isfinite(self.context_loss_weight)):
            raise ConfigError(f"context_loss_weight must be a number >= 0, got {self.context_loss_weight}")
        if not (self.value_loss_weight >= 0 and math.isfinite(self.value_loss_weight)):
            raise ConfigError(f"value_loss_weight must be a number >= 0, got {self.value_loss_weight}")
        if self.max_minutes <= 0:
            raise ConfigError(f"max_minutes must be > 0, got {self.max_minutes}")
        if not 0 <= self.copy_fraction < 1:
            raise ConfigError(f"copy_fraction must be in [0, 1), got {self.copy_fraction}")
        if not (isinstance(self.recall_fact_fillers, int) and 1 <= self.recall_fact_fillers <= 4):
            raise ConfigError(f"recall_fact_fillers must be an integer in [1, 4], got {self.recall_fact_fillers!r}")
        if not 0 <= self.recall_fraction < 1 or self.copy_fraction + self.recall_fraction >= 1:
            raise ConfigError(f"recall_fraction must be in [0, 1) and leave room for expert rows beside "
                              f"copy_fraction, got {self.recall_fraction}")
        if not 0 <= self.swap_names <= 1:
            raise ConfigError(f"swap_names must be in [0, 1], got {self.swap_names}")
        if not 0 <= self.swap_numbers <= 1:
            raise ConfigError(f"swap_numbers must be in [0, 1], got {self.swap_numbers}")
        if self.init_from and not (Path(self.init_from) / "config.json").is_file():
            raise ConfigError(f"init_from must be a saved policy folder (with config.json), got {self.init_from!r}")
        if self.copy_warmup_length < 16 or self.copy_warmup_length > self.batch_tokens:
            raise ConfigError(f"copy_warmup_length must be in [16, batch_tokens={self.batch_tokens}], "
                              f"got {self.copy_warmup_length}")
        if self.expert_split not in ("synthetic", "train"):
            raise ConfigError(f"expert_split must be 'synthetic' or 'train', got {self.expert_split!r}")
        if self.eval_temperature < 0:
            raise ConfigError(f"eval_temperature must be >= 0, got {self.eval_temperature}")

    def rollout_config(self, group_size: int = 1, temperature: float = 1.0, seed: int = 0):
        from .rollout import RolloutConfig

        return RolloutConfig(group_size=group_size, max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                             max_new_tokens_per_turn=self.max_new_tokens_per_turn, temperature=temperature,
                             seed=seed, system_prompt=self.system_prompt, include_tools=self.include_tools)


# --------------------------------------------------------------------------------------------------
# Expert data
# --------------------------------------------------------------------------------------------------


def expert_examples(tokenizer, cfg: SFTConfig, task_indices: list[int], split: str = "train",
                    cache_dir: Path | None = None) -> list[dict[str, torch.Tensor]]:
    """One example per task the oracle solves: ``{"input_ids": (L,), "loss_mask": (L,)}`` long tensors,
    cut at ``max_total_tokens``. Cached under ``cache_dir`` (a key of the tokenizer, tasks and settings)."""
    from .rollout import AgentBackend, collect_rollouts

    key = hashlib.sha256(json.dumps({
        "vocab": sorted(tokenizer.get_vocab().items()), "template": tokenizer.chat_template, "env": cfg.env_id,
        "split": split, "tasks": task_indices, "system": cfg.system_prompt, "tools": cfg.include_tools,
        "turns": cfg.max_turns, "new": cfg.max_new_tokens_per_turn,
        "max_total": cfg.max_total_tokens}, sort_keys=True).encode()).hexdigest()[:16]
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
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.replace(path)
    return out


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
                   groups: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``rows`` episode openings (:func:`episode_openings`) drawn at random, renamed with ``groups``
    (:func:`swap_names`; none: as they are), as a batch in the layout of :func:`collate` whose loss
    mask keeps only the first token of each value the expert writes in the opening's tool call
    (:func:`value_start_mask`, tables from :func:`value_start_tokens`): the tool's name and the
    identity lookup's e-mail, or first name, last name and zip code, read out of the customer's
    sentence. All rows are marked in ``copy_rows``, so :func:`sft_loss` scores only those tokens and
    averages over them.

    A full episode has a few such tokens among about a thousand, and the tiny model learns the
    conversation's form and copying from records long before it reads the customer's sentence; scored
    alone, with a loss of their own, these lookups are learned in a few hundred steps (see the module
    docstring)."""
    if not openings:
        raise ValueError("identity_batch needs at least one episode opening")
    picked = [openings[int(i)] for i in rng.integers(0, len(openings), rows)]
    if groups:
        picked = [swap_names(e, groups, rng) for e in picked]
    batch = collate(picked, pad_id)
    batch["loss_mask"] = value_start_mask(batch["input_ids"], batch["loss_mask"], *value_tables).to(
        batch["loss_mask"].dtype)
    batch["copy_rows"] = torch.ones(rows, dtype=torch.bool)
    return batch


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


def sft_loss(policy: TokenLogprobs, batch: dict[str, torch.Tensor],
             context_weight: float = 0.0, value_weight: float = 1.0) -> tuple[torch.Tensor, int]:
    """Weighted mean negative log-likelihood and the number of expert tokens (loss mask 1).

    Expert tokens weigh 1, the other real tokens of the episode ``context_weight`` (padding and each
    row's first token, which has no prefix, weigh 0); where ``batch`` has a ``value_mask``
    (:func:`value_start_mask`), those expert tokens weigh ``value_weight``."""
    logp, _ = policy(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    mask = batch["loss_mask"]
    real = batch["attention_mask"].to(mask.dtype)
    weight = (mask + context_weight * (1 - mask) * real) if context_weight else mask.clone()
    value_mask = batch.get("value_mask")
    if value_mask is not None and value_weight != 1.0:
        weight = torch.where(value_mask & (mask > 0), weight * value_weight, weight)
    copy_rows = batch.get("copy_rows")
    if copy_rows is not None and copy_rows.any():  # copy drills: only the repeats are scored
        weight[copy_rows] = mask[copy_rows]
        mask = mask[~copy_rows]
    weight[:, 0] = 0
    n = int(mask.sum())
    return -(logp * weight).sum() / weight.sum().clamp(min=1), n


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
    ``copy_rows`` (:func:`sft_loss` scores only their masked tokens)."""
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
    ``copy_rows``, where :func:`sft_loss` scores only their masked tokens."""
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


# --------------------------------------------------------------------------------------------------
# Evaluation and the loop
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def expert_token_accuracy(model, tokenizer, examples: list[dict[str, torch.Tensor]], batch_tokens: int = 8192) -> dict:
    """Teacher-forced greedy accuracy on the expert's tokens, by kind: the first token of a number
    (an order, item or payment id, a zip, a price: the token that says *which* value is copied),
    the following tokens of a number, and every other expert token; across those, the first token
    of each value the expert writes in its first tool call (``identity_call``: the tool's name and
    the e-mail, or first name, last name and zip, read out of the customer's sentence;
    :func:`value_start_mask`). Returns accuracies and counts.

    Where a policy's rollouts fail is usually visible here: a tiny model may continue a number it
    started well and still rarely start the right one."""
    digit = torch.zeros(max(len(tokenizer), int(model.get_output_embeddings().weight.shape[0])), dtype=torch.bool)
    for tok_id, text in enumerate(token_texts(tokenizer)):
        digit[tok_id] = bool(text) and text.isdigit()
    tables = value_start_tokens(tokenizer)
    tool_call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    was_training = model.training
    model.eval()
    hits = {"number_start": 0, "number_rest": 0, "other": 0, "identity_call": 0}
    counts = dict.fromkeys(hits, 0)
    lengths = [len(e["input_ids"]) for e in examples]
    try:
        for idx in length_batches(lengths, batch_tokens, np.random.default_rng(0)):
            batch = collate([examples[i] for i in idx], tokenizer.pad_token_id or 0)
            ids = batch["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"]).logits
            pred = torch.zeros_like(ids)
            pred[:, 1:] = logits[:, :-1].argmax(-1)
            scored = batch["loss_mask"].bool()
            scored[:, 0] = False
            is_digit = digit[ids]
            prev_digit = torch.zeros_like(is_digit)
            prev_digit[:, 1:] = is_digit[:, :-1]
            opening = torch.zeros_like(scored)
            for row, i in enumerate(idx):
                cut = episode_openings([examples[i]], tool_call_id)
                if cut:
                    opening[row, :len(cut[0]["input_ids"])] = True
            right = pred == ids
            for kind, sel in (("number_start", is_digit & ~prev_digit), ("number_rest", is_digit & prev_digit),
                              ("other", ~is_digit),
                              ("identity_call", value_start_mask(ids, scored, *tables) & opening)):
                m = scored & sel
                hits[kind] += int((right & m).sum())
                counts[kind] += int(m.sum())
    finally:
        model.train(was_training)
    return {**{f"acc_{k}": hits[k] / max(1, counts[k]) for k in hits}, **{f"n_{k}": counts[k] for k in counts}}


def evaluate_policy(model, tokenizer, cfg: SFTConfig, task_indices: list[int], split: str = "train",
                    samples: int = 1, temperature: float = 1.0, seed: int = 0, chunk: int = 20) -> dict:
    """Mean reward of ``model`` on ``task_indices`` (``samples`` episodes each, fixed seeds)."""
    from .rollout import HFBackend, collect_rollouts

    was_training = model.training
    model.eval()
    rewards, turns = [], []
    try:
        backend = HFBackend(model, tokenizer)
        for i in range(0, len(task_indices), chunk):
            b = collect_rollouts(backend, tokenizer, cfg.env_id, task_indices[i:i + chunk], split,
                                 cfg.rollout_config(samples, temperature, seed))
            rewards += b.rewards.tolist()
            turns += [s["turns"] for s in b.stats]
    finally:
        model.train(was_training)
    return {"reward": float(np.mean(rewards)), "success": float(np.mean([r >= 1 - 1e-6 for r in rewards])),
            "turns": float(np.mean(turns)), "episodes": len(rewards)}


@dataclass
class SFTResult:
    model: torch.nn.Module
    tokenizer: object
    history: list[dict]
    steps: int
    stopped_early: bool
    out_dir: Path | None


def copy_warmup(policy: TokenLogprobs, cfg: SFTConfig, token_ids: torch.Tensor, rng: np.random.Generator
                ) -> list[float]:
    """``cfg.copy_warmup_steps`` optimizer steps on :func:`copy_drill_batch` alone (rows of
    ``cfg.copy_warmup_length`` tokens, ``cfg.batch_tokens`` per step; learning rate ``cfg.lr`` after
    a linear warm-up; its own AdamW, discarded after). Returns the loss of every step."""
    return drill_warmup(policy, cfg, cfg.copy_warmup_steps, "copy warm-up",
                        lambda rows, length: copy_drill_batch(rows, length, token_ids, rng))


def recall_warmup(policy: TokenLogprobs, cfg: SFTConfig, token_ids: torch.Tensor, fillers: torch.Tensor,
                  rng: np.random.Generator) -> list[float]:
    """``cfg.recall_warmup_steps`` optimizer steps on :func:`recall_drills` alone, as
    :func:`copy_warmup` (rows of ``cfg.copy_warmup_length`` tokens). Returns the loss of every step."""
    return drill_warmup(policy, cfg, cfg.recall_warmup_steps, "recall warm-up",
                        lambda rows, length: drill_batch(*recall_drills(rows, length, token_ids, fillers, rng,
                                                           fact_fillers=(1, cfg.recall_fact_fillers))))


def identity_warmup(policy: TokenLogprobs, cfg: SFTConfig, openings: list[dict[str, torch.Tensor]],
                    groups: list[torch.Tensor], pad_id: int, value_tables, rng: np.random.Generator) -> list[float]:
    """``cfg.identity_warmup_steps`` optimizer steps on :func:`identity_batch` alone, as
    :func:`copy_warmup` (about ``cfg.batch_tokens`` real tokens per step). Returns the loss of every step."""
    rows = max(1, round(cfg.batch_tokens / np.mean([len(e["input_ids"]) for e in openings])))
    return drill_warmup(policy, cfg, cfg.identity_warmup_steps, "identity warm-up",
                        lambda *_: identity_batch(openings, rows, rng, pad_id, value_tables, groups))


def drill_warmup(policy: TokenLogprobs, cfg: SFTConfig, steps: int, desc: str, make_batch) -> list[float]:
    """``steps`` optimizer steps on the batches ``make_batch(rows, length)`` returns (rows of
    ``cfg.copy_warmup_length`` tokens, ``cfg.batch_tokens`` per step; learning rate ``cfg.lr`` after a
    linear warm-up of ``cfg.warmup_steps``; its own AdamW, discarded after). Returns the loss of every
    step and prints the first and last (stderr)."""
    model = policy.lm
    length = cfg.copy_warmup_length
    rows = max(1, cfg.batch_tokens // length)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    losses = []
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)
    try:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
            loss, _ = sft_loss(policy, make_batch(rows, length))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    if losses:
        tail = losses[-min(len(losses), 20):]
        print(f"sft: {desc} {len(losses)} steps, loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} "
              f"(mean of the last {len(tail)})", file=sys.stderr)
    return losses


def train_sft(cfg: SFTConfig, save: bool = True) -> SFTResult:
    """Build the tiny policy, train it on expert episodes, stop early; save it (``save_pretrained``
    with its tokenizer, plus ``sft_history.csv`` and ``sft_config.json``) to ``cfg.out_dir``."""
    import gymnasium as gym

    import sinkflex_core  # noqa: F401  (registers the environments)

    from . import models
    from .paths import build_dir

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    def num_tasks(split: str) -> int:
        env = gym.make(cfg.env_id, split=split)
        try:
            return env.unwrapped.num_tasks
        finally:
            env.close()

    n_tasks = num_tasks("train")
    if cfg.val_tasks >= n_tasks:
        raise ConfigError(f"val_tasks ({cfg.val_tasks}) leaves no training task of {n_tasks}")
    val_ids = list(range(n_tasks - cfg.val_tasks, n_tasks))
    if cfg.expert_split == "train":
        n_train = min(cfg.train_tasks or n_tasks - cfg.val_tasks, n_tasks - cfg.val_tasks)
    else:
        n_available = num_tasks(cfg.expert_split)
        n_train = min(cfg.train_tasks or n_available, n_available)

    tokenizer = models.load_tokenizer(cfg.init_from) if cfg.init_from else models.get_tokenizer(cfg.vocab_size)
    data = expert_examples(tokenizer, cfg, list(range(n_train)), split=cfg.expert_split,
                           cache_dir=build_dir() / "sft_cache")
    if not data:
        raise RuntimeError("the oracle solved none of the training tasks: no expert data")
    openings = []
    if cfg.opening_copies or cfg.identity_rows or cfg.identity_warmup_steps:
        openings = episode_openings(data, tokenizer.convert_tokens_to_ids("<tool_call>"))
        if not openings:
            raise RuntimeError("no expert episode calls a tool: no episode openings for the identity lookup")
    if cfg.opening_copies:
        data = data + openings * cfg.opening_copies
        print(f"sft: {len(openings)} episode openings x {cfg.opening_copies} added "
              f"({sum(len(e['input_ids']) for e in openings) * cfg.opening_copies:,} tokens)", file=sys.stderr)
    if cfg.init_from:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, attn_implementation="sdpa").train()
    else:
        mcfg = models.tiny_qwen2_config(vocab_size=max(cfg.vocab_size, len(tokenizer)), hidden_size=cfg.hidden_size,
                                        num_layers=cfg.num_layers, num_heads=cfg.num_heads or None,
                                        num_kv_heads=cfg.num_kv_heads or None, tokenizer=tokenizer)
        mcfg._attn_implementation = "sdpa"
        model = models.build_model(mcfg, seed=cfg.seed).train()
        if cfg.previous_token_heads:
            models.init_previous_token_heads(model, n_pos=cfg.max_total_tokens)
    policy = TokenLogprobs(model)
    # every id but pad and end-of-text (the only two all_special_ids names): the drills, as recorded, also
    # copy the chat tokens and the ~630 reserved ids that the episodes never contain
    special = set(tokenizer.all_special_ids)
    copy_tokens = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    if cfg.copy_warmup_steps and not cfg.init_from:
        copy_warmup(policy, cfg, copy_tokens, rng)
    recall = recall_tokens(tokenizer, data) if cfg.recall_fraction or cfg.recall_warmup_steps else None
    if cfg.recall_warmup_steps:
        recall_warmup(policy, cfg, *recall, rng)
    pad = tokenizer.pad_token_id or 0
    swap_groups = []
    if cfg.swap_names:
        swap_groups = name_swap_groups(tokenizer, data)
        print(f"sft: renaming {cfg.swap_names:.0%} of the episodes; words per group: "
              f"{[len(g) for g in swap_groups]}", file=sys.stderr)
    tables = value_start_tokens(tokenizer) if cfg.value_loss_weight != 1.0 or openings else None
    numbers = number_swap_group(tokenizer) if openings or cfg.swap_numbers else torch.zeros(0, dtype=torch.long)
    numbers = numbers if len(numbers) >= 2 else torch.zeros(0, dtype=torch.long)  # a tokenizer without them
    # identity batches are renamed and renumbered: a training user's order id is otherwise a key to
    # remembering their zip code
    identity_groups = swap_groups + ([numbers] if len(numbers) else []) if openings else []
    if cfg.identity_warmup_steps:
        identity_warmup(policy, cfg, openings, identity_groups, pad, tables, rng)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    horizon = cfg.schedule_steps or cfg.max_steps

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        done = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))

    out_dir = Path(cfg.out_dir) if save else None
    history: list[dict] = []
    lengths = [len(e["input_ids"]) for e in data]
    number_group = [numbers] if cfg.swap_numbers and len(numbers) else []
    if number_group:
        print(f"sft: renumbering {cfg.swap_numbers:.0%} of the episodes ({len(number_group[0])} three-digit tokens)",
              file=sys.stderr)
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, desc="sft", unit="step", dynamic_ncols=True, file=sys.stderr)
    t0 = time.perf_counter()
    step, epoch, stopped, done = 0, 0, False, False
    best_reward, best_state = -1.0, None
    loss_sum, tok_sum, id_sum, id_steps = 0.0, 0, 0.0, 0
    try:
        while not done:
            for idx in length_batches(lengths, cfg.batch_tokens, rng):
                rows = [data[i] for i in idx]
                if cfg.swap_names:
                    rows = [swap_names(e, swap_groups, rng) if rng.random() < cfg.swap_names else e for e in rows]
                if number_group:
                    rows = [swap_names(e, number_group, rng) if rng.random() < cfg.swap_numbers else e for e in rows]
                batch = collate(rows, pad)
                B, L = batch["input_ids"].shape
                if cfg.copy_fraction:
                    batch = add_copy_rows(batch, cfg.copy_fraction, copy_tokens, rng)
                if cfg.recall_fraction:
                    batch = add_drill_rows(batch, *recall_drills(drill_row_count(B, cfg.recall_fraction), L, *recall,
                                                                 rng, fact_fillers=(1, cfg.recall_fact_fillers)))
                if cfg.value_loss_weight != 1.0:
                    batch["value_mask"] = value_start_mask(batch["input_ids"], batch["loss_mask"], *tables)
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                loss, n = sft_loss(policy, batch, cfg.context_loss_weight, cfg.value_loss_weight)
                expert_loss = loss.item()
                if cfg.identity_rows:
                    id_loss, _ = sft_loss(policy, identity_batch(openings, cfg.identity_rows, rng, pad, tables,
                                                                 identity_groups))
                    id_sum, id_steps = id_sum + id_loss.item(), id_steps + 1
                    loss = loss + id_loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                loss_sum += expert_loss * n
                tok_sum += n
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{expert_loss:.3f}", refresh=False)
                done = step >= cfg.max_steps or (time.perf_counter() - t0) / 60 >= cfg.max_minutes
                if step % cfg.eval_every == 0 or done:
                    ev = evaluate_policy(model, tokenizer, cfg, val_ids, samples=cfg.eval_samples,
                                         temperature=cfg.eval_temperature, seed=cfg.seed)
                    row = {"step": step, "epoch": epoch, "loss": loss_sum / max(1, tok_sum), "lr": lr_at(step),
                           "val_reward": ev["reward"], "val_success": ev["success"], "val_turns": ev["turns"],
                           "elapsed_s": time.perf_counter() - t0, "best": False}
                    if cfg.identity_rows:  # the mean loss of the identity batches since the last evaluation
                        row["identity_loss"] = id_sum / max(1, id_steps)
                    history.append(row)
                    loss_sum, tok_sum, id_sum, id_steps = 0.0, 0, 0.0, 0
                    if cfg.keep_best and ev["reward"] >= best_reward:
                        best_reward = ev["reward"]
                        best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                        row["best"] = True
                    msg = f"sft step {step}: loss {row['loss']:.4f}, validation reward {ev['reward']:.3f}"
                    if bar is not None:
                        bar.write(msg)
                    else:  # without a progress bar the evaluations are still logged
                        print(msg, file=sys.stderr)
                    if out_dir is not None:
                        _write_history(out_dir / "sft_history.csv", history)
                        if cfg.save_snapshots:
                            snap = out_dir / "snapshots" / f"step_{step:06d}"
                            model.save_pretrained(snap)
                            tokenizer.save_pretrained(snap)
                    if cfg.stop_at_reward > 0 and ev["reward"] >= cfg.stop_at_reward and step >= cfg.min_steps:
                        stopped = done = True
                if done:
                    break
            epoch += 1
    finally:
        if bar is not None:
            bar.close()
    if cfg.keep_best and best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "sft_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
        _write_history(out_dir / "sft_history.csv", history)
    return SFTResult(model=model, tokenizer=tokenizer, history=history, steps=step, stopped_early=stopped,
                     out_dir=out_dir)


#: The second stage of the recorded SFT start (:func:`identity_stage`): continue a finished SFT run
#: with the identity lookup scored on its own (:func:`identity_batch`).
IDENTITY_STAGE = {"identity_warmup_steps": 300, "identity_rows": 8, "max_steps": 500, "eval_every": 250}


def saved_config(folder: str | Path) -> dict:
    """The fields of :class:`SFTConfig` in ``folder``'s ``sft_config.json`` (others, from older or newer
    versions, dropped)."""
    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    return {k: v for k, v in json.loads((Path(folder) / "sft_config.json").read_text()).items() if k in fields}


def identity_stage(base_dir: str | Path, out_dir: str | Path, **overrides) -> SFTConfig:
    """The config of the identity stage: :data:`IDENTITY_STAGE` on top of the saved config of the SFT
    run in ``base_dir`` (``init_from`` it), writing to ``out_dir``; ``overrides`` last. The recorded
    start of the small-scale reproduction is ``runs/curve/sft`` (the defaults) continued this way
    into ``runs/curve/sft_identity``; on the command line::

        python -m sinkflex_core.sft --init-from runs/curve/sft --identity-warmup-steps 300 \\
            --identity-rows 8 --max-steps 500 --eval-every 250 --out-dir runs/curve/sft_identity
    """
    values = saved_config(base_dir)
    values.update(IDENTITY_STAGE, init_from=str(base_dir), out_dir=str(out_dir), **overrides)
    return SFTConfig(**values)


def train_or_reuse(cfg: SFTConfig) -> Path:
    """Train ``cfg`` into ``cfg.out_dir`` unless that folder already holds a policy trained with the
    same config (``threads``, ``progress``, ``out_dir`` and ``save_snapshots`` aside; a field the saved
    config lacks, added since, counts as its default); returns the folder."""
    out = Path(cfg.out_dir)

    def key(values: dict) -> dict:
        return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(SFTConfig(**values)))).items()
                if k not in ("threads", "progress", "out_dir", "save_snapshots")}

    if (out / "sft_config.json").is_file() and (out / "model.safetensors").is_file():
        if key(saved_config(out)) == key(dataclasses.asdict(cfg)):
            print(f"SFT: reusing {out} (same config)", file=sys.stderr, flush=True)
            return out
    print(f"SFT: training -> {out}", file=sys.stderr, flush=True)
    result = train_sft(cfg)
    last = result.history[-1]
    print(f"SFT: {result.steps} steps, {last['elapsed_s'] / 60:.1f} min, validation reward {last['val_reward']:.3f}",
          file=sys.stderr, flush=True)
    return out


def _write_history(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sinkflex_core.sft", description=__doc__.split("\n\n")[0])
    add_config_arguments(p, SFTConfig, keep_defaults=True)
    args = vars(p.parse_args(argv))
    try:
        values = {k: (parse_field(SFTConfig, k, v) if isinstance(v, str) else v) for k, v in args.items()}
        result = train_sft(SFTConfig(**values))
    except ConfigError as err:
        print(f"sft: config error: {err}", file=sys.stderr)
        return 2
    last = result.history[-1] if result.history else {}
    print(f"sft: {result.steps} steps, stopped early: {result.stopped_early}, validation reward "
          f"{last.get('val_reward', float('nan')):.3f}; saved to {result.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
