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
- the attention: full causal attention by default; ``attention="sinkflex"`` trains under the sink
  attention of GRPO's ``tiny-cpu`` preset (``n_sink``, ``window``, ``learn_sinks``, ``layer_sinks``, as
  :class:`sinkflex_core.train.TrainConfig` names them) in every forward, the learned sink logits with the
  weights, and saves the settings beside them (:func:`sinkflex_core.models.load_policy` restores them);
- optional stages, off by default: key-value recall drills (``recall_*``), a heavier loss on the
  first token of tool-call values (``value_loss_weight``), the identity stage that scores the values
  of the identity call alone (``identity_*``; :data:`IDENTITY_STAGE` is the recorded second stage),
  the later calls' values scored alone (``action_rows``; ``action_tools`` keeps the calls of some
  tools, ``action_messages`` adds the messages, ``action_confirmations`` only those before those tools'
  calls; ``short_action_rows``, the same turns with the episode's middle cut away, ``short_warmup_steps``
  of them alone first), renumbering of two-digit tokens
  (``swap_digit_pairs``); :data:`LOOKUP_STAGE` combines them;
- early stopping: every ``eval_every`` optimizer steps the policy plays held-out training tasks (the
  last ``val_tasks`` of the ``"train"`` split, never in the SFT data) with the rollout settings of the
  GRPO run; training stops at the first evaluation whose mean reward reaches ``stop_at_reward`` (the
  paper's starting point is 0.25), or at ``max_steps`` / ``max_minutes``, keeping the best weights.

The expert data and the drills are built in :mod:`sinkflex_core.sft_data` (their names are also
importable from here). What each choice changed, and what was tried and dropped, with the commands
and figures: ``docs/experiments.md``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import models
from .models import DEFAULT_VOCAB_SIZE
from .paths import write_text_atomic
from .sft_data import (  # noqa: F401  (re-exported: sft.<name> stays valid)
    RECALL_FILLER_WORDS,
    action_batch,
    action_cuts,
    add_copy_rows,
    add_drill_rows,
    call_name,
    collate,
    copy_drill_batch,
    copy_drills,
    digit_pair_group,
    drill_batch,
    drill_row_count,
    episode_openings,
    expert_examples,
    identity_batch,
    length_batches,
    name_swap_groups,
    number_swap_group,
    quote_tokens,
    recall_drills,
    recall_tokens,
    short_context,
    swap_names,
    token_texts,
    value_start_mask,
    value_start_tokens,
    whole_values,
)
from .train import (
    COMPACT_SYSTEM_PROMPT,
    SEED_LIMIT,
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
    # -- attention (as TrainConfig's: train the start with the attention GRPO will use) --
    attention: str = option("sdpa", "sdpa (full causal attention) | sinkflex (sink-aware attention, "
                                    "attention.apply, for every forward of the SFT: loss, drills, evaluations)")
    n_sink: int = option(4, "sinkflex: sink tokens kept at the start of each document")
    window: int = option(4096, "sinkflex: sliding window (keys)")
    learn_sinks: bool = option(True, "sinkflex: learn a zero-value sink logit per head (trained with the weights)")
    layer_sinks: str | list[int] = option("", 'sinkflex: per-layer sink counts. "": n_sink in every layer; a list '
                                              '(on the command line: comma-separated, "4,4,8,4"); a JSON file '
                                              'written by attention.save_layer_sinks, or a folder holding '
                                              'sinkflex_sinks.json')
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
    swap_digit_pairs: bool = option(False, "renumbering (of the episodes and of the identity rows) also "
                                           "permutes the two-digit tokens (digit_pair_group): a zip code's "
                                           "last digits")
    identity_rows: int = option(0, "episode openings per optimizer step whose identity-call values add their "
                                   "own mean loss to the step's (identity_batch)")
    action_rows: int = option(0, "episodes per optimizer step, each cut after one of the expert's later tool "
                                 "calls, whose values add their own mean loss (action_batch)")
    action_tools: str = option("", "comma-separated tool names: the action rows cut only at calls of these "
                                   "tools ('': every call after the first)")
    short_action_rows: int = option(0, "rows per optimizer step cut as the action rows are (action_tools, "
                                    "action_messages) with the episode's middle cut away: the system turn, the "
                                    "customer's sentences, the expert's messages, the tool outputs holding a "
                                    "value of the call, the turn (sft_data.short_context)")
    action_messages: bool = option(False, "the action rows also cut after the expert's messages between its "
                                          "first and last tool call (the confirmation of a write call), every "
                                          "token of the message scored")
    action_confirmations: bool = option(False, "with action_tools and action_messages: only the messages whose "
                                               "next expert call is one of action_tools (its confirmation)")
    short_warmup_steps: int = option(0, "optimizer steps on short action rows alone (about batch_tokens a step) "
                                        "before the SFT, as the identity warm-up")
    short_warmup_rows: int = option(0, "short action rows per step of the short-row warm-up (0: about "
                                       "batch_tokens a step)")
    identity_values: str = option("first", "what the identity and action rows score of each value of their "
                                           "call: 'first' (its first token) or 'whole' (every token, "
                                           "whole_values)")
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
                                         "`zip 92181`; 3: also `email is lucia...`; 0: none in the fact "
                                         "nor in the question, plain one-token induction: `921 81`)")
    recall_plain_share: float = option(0.0, "share of the recall drill rows without separators (plain one-token "
                                            "induction) beside those of recall_fact_fillers >= 1: both lookups "
                                            "of a zip code drilled together")
    min_lr_ratio: float = option(0.1, "end of the cosine decay, as a share of lr")
    warmup_steps: int = option(30, "optimizer steps of linear warm-up")
    weight_decay: float = option(0.01, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient-norm clip")
    max_steps: int = option(3000, "optimizer steps at most (0: only the warm-ups, with at least one)")
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
    bf16: bool = option(False, "the decoder's matrix products in bfloat16 (torch.autocast) in the training "
                               "steps; weights, optimizer and log-prob head stay float32, evaluations play in "
                               "float32 (benchmarks/bench_sft_step.py measures the gain)")
    device: str = option("auto", "where the model trains and plays its evaluations: auto (the first GPU when "
                                 "torch sees one, else the CPU), cpu, cuda or cuda:N; the expert episodes and "
                                 "the drills are made on the CPU")
    progress: bool = option(True, "a progress bar on stderr")
    out_dir: str = option("runs/sft", "where the policy, its tokenizer and the history go")

    def _actions(self) -> bool:
        """Whether the run draws rows cut at the expert's later turns (:func:`action_cuts`)."""
        return bool(self.action_rows or self.short_action_rows or self.short_warmup_steps)

    def _warmups(self) -> int:
        """The optimizer steps of the warm-ups this run trains before the SFT's own steps."""
        copy = 0 if self.init_from else self.copy_warmup_steps
        return copy + self.recall_warmup_steps + self.identity_warmup_steps + self.short_warmup_steps

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "max_turns", "max_total_tokens", "copy_warmup_length",
                     "max_new_tokens_per_turn", "batch_tokens", "eval_every", "eval_samples"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("train_tasks", "val_tasks", "warmup_steps", "min_steps", "threads", "schedule_steps",
                     "num_heads", "num_kv_heads", "copy_warmup_steps", "opening_copies",
                     "recall_warmup_steps", "identity_warmup_steps", "identity_rows", "action_rows", "short_action_rows",
                     "short_warmup_steps", "short_warmup_rows", "max_steps", "seed"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                raise ConfigError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.max_steps == 0 and not self._warmups():
            raise ConfigError("max_steps 0 trains only the warm-ups, and this config has none: set max_steps >= 1 "
                              "or one of copy_warmup_steps (a new model), recall_warmup_steps, identity_warmup_steps, "
                              "short_warmup_steps")
        for name in (f.name for f in dataclasses.fields(self) if f.type in (bool, "bool")):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self.torch_device()  # a device this machine lacks is refused before the expert data and the model
        if self.seed >= SEED_LIMIT:
            raise ConfigError(f"seed must be below 2**63 (torch's generators take 64 bits), got {self.seed}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (self.context_loss_weight >= 0 and math.isfinite(self.context_loss_weight)):
            raise ConfigError(f"context_loss_weight must be a number >= 0, got {self.context_loss_weight}")
        if not (self.value_loss_weight >= 0 and math.isfinite(self.value_loss_weight)):
            raise ConfigError(f"value_loss_weight must be a number >= 0, got {self.value_loss_weight}")
        if not self.max_minutes > 0:  # nan too
            raise ConfigError(f"max_minutes must be > 0, got {self.max_minutes}")
        if not (self.grad_clip > 0 and math.isfinite(self.grad_clip)):
            raise ConfigError(f"grad_clip must be a positive number, got {self.grad_clip}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError(f"weight_decay must be a number >= 0, got {self.weight_decay}")
        if not 0 <= self.copy_fraction < 1:
            raise ConfigError(f"copy_fraction must be in [0, 1), got {self.copy_fraction}")
        if not (isinstance(self.recall_fact_fillers, int) and 0 <= self.recall_fact_fillers <= 4):
            raise ConfigError(f"recall_fact_fillers must be an integer in [0, 4], got {self.recall_fact_fillers!r}")
        if (self.action_tools or self.action_messages) and not self._actions():
            raise ConfigError("action_tools and action_messages choose what the action rows drill: set action_rows, "
                              "short_action_rows or short_warmup_steps")
        if self.action_confirmations and not (self.action_tools and self.action_messages):
            raise ConfigError("action_confirmations keeps the messages before the calls of action_tools: set "
                              "action_tools and action_messages")
        if self.identity_values not in ("first", "whole"):
            raise ConfigError(f"identity_values must be 'first' or 'whole', got {self.identity_values!r}")
        if not 0 <= self.recall_plain_share <= 1:
            raise ConfigError(f"recall_plain_share must be in [0, 1], got {self.recall_plain_share}")
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
        if not (self.eval_temperature >= 0 and math.isfinite(self.eval_temperature)):
            raise ConfigError(f"eval_temperature must be a number >= 0, got {self.eval_temperature}")
        if self.attention not in ("sdpa", "sinkflex"):
            raise ConfigError(f"attention must be 'sdpa' or 'sinkflex', got {self.attention!r}")
        if not (isinstance(self.n_sink, int) and self.n_sink >= 0):
            raise ConfigError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ConfigError(f"window must be a positive integer, got {self.window!r}")
        if not self.init_from:  # the new model's shape, before the expert data and the warm-ups
            from .models import tiny_qwen2_config

            try:
                mcfg = tiny_qwen2_config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                         num_layers=self.num_layers, num_heads=self.num_heads or None,
                                         num_kv_heads=self.num_kv_heads or None)
            except ValueError as err:
                raise ConfigError(f"model shape: {err}") from None
            group = mcfg.num_attention_heads // mcfg.num_key_value_heads
            if self.previous_token_heads and group < 2:
                raise ConfigError(f"previous_token_heads needs two query heads per key-value head, got "
                                  f"{mcfg.num_attention_heads} heads and {mcfg.num_key_value_heads} key-value "
                                  f"heads (set num_kv_heads lower, or previous_token_heads false)")
            n_layers = self.num_layers
        else:
            n_layers = json.loads((Path(self.init_from) / "config.json").read_text()).get("num_hidden_layers")
        if self.attention == "sinkflex":
            counts = self.sink_counts()  # a missing or malformed layer_sinks is refused before any work
            if counts is not None and n_layers is not None and len(counts) != n_layers:
                raise ConfigError(f"layer_sinks has {len(counts)} counts for a model of {n_layers} layers")

    def torch_device(self) -> torch.device:
        """The :class:`torch.device` of ``device`` (``auto``: ``cuda:0`` where torch sees a GPU, else the
        CPU); a device this machine does not have is a :class:`ConfigError`."""
        spec = self.device
        if spec == "auto":
            return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        try:
            dev = torch.device(spec) if isinstance(spec, str) else None
        except RuntimeError:
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"device {spec!r}: torch sees no CUDA GPU on this machine (use 'cpu' or 'auto')")
            if (dev.index or 0) >= torch.cuda.device_count():
                raise ConfigError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def sink_counts(self) -> list[int] | None:
        """The per-layer sink counts ``layer_sinks`` names (None: ``n_sink`` in every layer)."""
        spec = self.layer_sinks
        if isinstance(spec, str) and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", spec):
            return [int(x) for x in spec.split(",")]
        if spec == "auto":  # GRPO estimates them on its start; an SFT continues from a start it names
            raise ConfigError('layer_sinks="auto" is not an SFT option: estimate the counts first '
                              '(start.estimate_sinks) and pass the folder or its sinkflex_sinks.json')
        if isinstance(spec, str) and spec:
            from .attention import load_layer_sinks

            try:
                return load_layer_sinks(spec)
            except (FileNotFoundError, ValueError, KeyError) as err:
                raise ConfigError(f"layer_sinks: {err}") from None
        if isinstance(spec, list | tuple) and spec:
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in spec):
                raise ConfigError(f"layer_sinks must hold integers >= 0, got {spec!r}")
            return list(spec)
        if spec in ("", [], ()):
            return None
        raise ConfigError(f"layer_sinks must be a list of counts, a JSON file or a folder, got {spec!r}")

    def sink_settings(self) -> dict | None:
        """The keyword arguments of :func:`sinkflex_core.attention.apply` this config trains with; None
        for full attention."""
        if self.attention != "sinkflex":
            return None
        return {"n_sink": self.n_sink, "window": self.window, "learn_sinks": self.learn_sinks,
                "layer_sinks": self.sink_counts()}

    def rollout_config(self, group_size: int = 1, temperature: float = 1.0, seed: int = 0):
        from .rollout import RolloutConfig

        return RolloutConfig(group_size=group_size, max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                             max_new_tokens_per_turn=self.max_new_tokens_per_turn, temperature=temperature,
                             seed=seed, system_prompt=self.system_prompt, include_tools=self.include_tools)


def sft_loss(policy: TokenLogprobs, batch: dict[str, torch.Tensor],
             context_weight: float = 0.0, value_weight: float = 1.0) -> tuple[torch.Tensor, int]:
    """Weighted mean negative log-likelihood and the number of expert tokens (loss mask 1).

    Expert tokens weigh 1, the other real tokens of the episode ``context_weight`` (padding and each
    row's first token, which has no prefix, weigh 0); where ``batch`` has a ``value_mask``
    (:func:`value_start_mask`), those expert tokens weigh ``value_weight``. Rows marked in ``copy_rows``
    (the drills, and every row of :func:`action_batch` and :func:`identity_batch`, whose loss masks
    already hold only the values) are weighed by their loss mask alone: neither ``context_weight`` nor
    ``value_weight`` applies to them."""
    dev = getattr(getattr(policy, "lm", None), "device", None)  # None: a stand-in policy of the tests
    if dev is not None and batch["input_ids"].device != dev:  # the batches are made on the CPU
        batch = {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
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


def descend(loss: torch.Tensor, model: torch.nn.Module, opt: torch.optim.Optimizer, grad_clip: float) -> None:
    """One optimizer step of the SFT on ``loss``: backward, the gradient norm clipped to ``grad_clip``,
    the step, the gradients freed (every loop of this module and ``benchmarks/bench_sft_step.py``)."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


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
    device = getattr(model, "device", torch.device("cpu"))
    digit = torch.zeros(max(len(tokenizer), int(model.get_output_embeddings().weight.shape[0])), dtype=torch.bool,
                        device=device)
    for tok_id, text in enumerate(token_texts(tokenizer)):
        digit[tok_id] = bool(text) and text.isdigit()
    tables = tuple(t.to(device) for t in value_start_tokens(tokenizer))
    tool_call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    was_training = model.training
    model.eval()
    hits = {"number_start": 0, "number_rest": 0, "other": 0, "identity_call": 0}
    counts = dict.fromkeys(hits, 0)
    lengths = [len(e["input_ids"]) for e in examples]
    try:
        for idx in length_batches(lengths, batch_tokens, np.random.default_rng(0)):
            batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], tokenizer.pad_token_id or 0).items()}
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
                        lambda rows, length: drill_batch(*recall_rows(cfg, rows, length, token_ids, fillers, rng)))


#: The layout of :func:`recall_drills` without separators: plain induction from one token.
PLAIN_RECALL = {"fact_fillers": (0, 0), "ask_fillers": (0, 0)}


def recall_rows(cfg: SFTConfig, rows: int, length: int, token_ids: torch.Tensor, fillers: torch.Tensor,
                rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` :func:`recall_drills` of ``length`` tokens in the layout of ``cfg`` (:func:`recall_layout`):
    with ``cfg.recall_plain_share`` in (0, 1], each row is without separators with that probability.
    Returns ``(input_ids, loss_mask)``."""
    share = cfg.recall_plain_share if cfg.recall_fact_fillers else 0.0
    plain = int(rng.binomial(rows, share)) if share else 0
    parts = [recall_drills(n, length, token_ids, fillers, rng, **layout)
             for n, layout in ((rows - plain, recall_layout(cfg)),
                               (plain, PLAIN_RECALL)) if n]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def recall_layout(cfg: SFTConfig) -> dict[str, tuple[int, int]]:
    """The separators of the recall drills (:func:`recall_drills`' ``fact_fillers`` and ``ask_fillers``)
    that ``cfg.recall_fact_fillers`` asks for: none anywhere for 0, else 1 to that many in the fact and
    the drills' default in the question."""
    n = cfg.recall_fact_fillers
    return dict(PLAIN_RECALL) if n == 0 else {"fact_fillers": (1, n)}


def identity_warmup(policy: TokenLogprobs, cfg: SFTConfig, openings: list[dict[str, torch.Tensor]],
                    groups: list[torch.Tensor], pad_id: int, value_tables, rng: np.random.Generator,
                    quotes: torch.Tensor | None = None) -> list[float]:
    """``cfg.identity_warmup_steps`` optimizer steps on :func:`identity_batch` alone, as
    :func:`copy_warmup` (about ``cfg.batch_tokens`` real tokens per step; ``quotes``: whole values
    scored, ``cfg.identity_values``). Returns the loss of every step."""
    rows = max(1, round(cfg.batch_tokens / np.mean([len(e["input_ids"]) for e in openings])))
    return drill_warmup(policy, cfg, cfg.identity_warmup_steps, "identity warm-up",
                        lambda *_: identity_batch(openings, rows, rng, pad_id, value_tables, groups, quotes))


def short_warmup(policy: TokenLogprobs, cfg: SFTConfig, data: list[dict[str, torch.Tensor]],
                 cuts: list[tuple[int, int, int, bool]], short: tuple[list[str], int], groups: list[torch.Tensor],
                 pad_id: int, value_tables, rng: np.random.Generator, quotes: torch.Tensor | None = None
                 ) -> list[float]:
    """``cfg.short_warmup_steps`` optimizer steps on short action rows alone (:func:`action_batch` with
    ``short``, :func:`short_context`), as :func:`identity_warmup` (about ``cfg.batch_tokens`` real tokens
    per step, the rows' mean length taken from up to 256 cuts spread over ``cuts``; ``cfg.short_warmup_rows``
    rows a step where it is set). Returns the loss of every step."""
    rows = cfg.short_warmup_rows
    if not rows:
        sample = cuts[::max(1, len(cuts) // 256)]
        mean = np.mean([len(short_context(data[n], a, b, *short)["input_ids"]) for n, a, b, _ in sample])
        rows = max(1, round(cfg.batch_tokens / mean))
    return drill_warmup(policy, cfg, cfg.short_warmup_steps, "short-row warm-up",
                        lambda *_: action_batch(data, cuts, rows, rng, pad_id, value_tables, groups, quotes,
                                                short=short))


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
            descend(loss, model, opt, cfg.grad_clip)
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


@dataclass
class _Ingredients:
    """What the SFT loop builds its batches from, made once before it (:func:`_prepare`)."""
    tokenizer: object
    data: list[dict[str, torch.Tensor]]
    openings: list[dict[str, torch.Tensor]]
    val_ids: list[int]
    pad: int
    copy_tokens: torch.Tensor
    recall: tuple[torch.Tensor, torch.Tensor] | None
    swap_groups: list[torch.Tensor]
    number_group: list[torch.Tensor]
    identity_groups: list[torch.Tensor]
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    quotes: torch.Tensor | None = None  # identity rows score whole values (identity_values="whole")
    cuts: list[tuple[int, int, int]] | None = None  # the later tool calls, for action rows
    short: tuple[list[str], int] | None = None  # the token texts and the turn id, for short action rows


@dataclass
class _Progress:
    """The loop's state: optimizer steps and epochs done, the loss sums since the last evaluation,
    the evaluations so far and the best weights."""
    t0: float
    step: int = 0
    epoch: int = 0
    stopped: bool = False
    loss_sum: float = 0.0
    tok_sum: int = 0
    id_sum: float = 0.0
    id_steps: int = 0
    best_reward: float = -1.0
    best_state: dict[str, torch.Tensor] | None = None
    history: list[dict] = dataclasses.field(default_factory=list)


def train_sft(cfg: SFTConfig, save: bool = True) -> SFTResult:
    """Build the tiny policy, train it on expert episodes, stop early; save it (``save_pretrained``
    with its tokenizer, plus ``sft_history.csv`` and ``sft_config.json``) to ``cfg.out_dir``."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    # one generator for every random draw, in a fixed order: a run is repeatable from cfg.seed
    rng = np.random.default_rng(cfg.seed)
    out_dir = Path(cfg.out_dir) if save else None
    if out_dir is not None:  # before the training it would otherwise lose at the end
        _check_writable(out_dir)
    val_ids, n_train = _task_split(cfg)
    tokenizer, data, openings = _expert_data(cfg, n_train)
    init_digest = _weights_digest(cfg.init_from) if cfg.init_from else None
    with models.loading_bars(cfg.progress):
        model = _build_model(cfg, tokenizer).to(cfg.torch_device())  # before the optimizer: its state follows
        policy = TokenLogprobs(model, autocast_dtype=torch.bfloat16 if cfg.bf16 else None)
    if out_dir is not None:  # counts estimated on the weights this run replaces (start.build re-estimates them)
        from .attention import SINKS_FILENAME

        if Path(cfg.init_from or "").resolve() != out_dir.resolve():
            (out_dir / SINKS_FILENAME).unlink(missing_ok=True)
    kit = _prepare(policy, cfg, tokenizer, data, openings, val_ids, rng)
    # max_steps 0: the warm-ups alone, kept as they end (no evaluation, an empty history)
    progress = _train_loop(policy, cfg, kit, rng, out_dir) if cfg.max_steps else _Progress(t0=time.perf_counter())
    model = policy.lm
    if cfg.keep_best and progress.best_state is not None:
        model.load_state_dict(progress.best_state)
    model.eval()
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        _unmark_finished(out_dir)
        with models.loading_bars(cfg.progress):
            _save_policy(model, tokenizer, out_dir)
        _write_history(out_dir / "sft_history.csv", progress.history)
        # last, and whole or not at all: sft_config.json marks a finished run (train_or_reuse reuses it)
        # with the digest of the weights it continued (train_or_reuse: a base trained again makes it stale)
        extra = {"init_from_digest": init_digest} if init_digest else {}
        if cfg.init_from:  # the shape of the weights continued, not the command's (unused) shape fields
            extra.update(_shape_fields(model.config))
        write_text_atomic(out_dir / "sft_config.json", json.dumps({**dataclasses.asdict(cfg), **extra}, indent=1) + "\n")
    return SFTResult(model=model, tokenizer=tokenizer, history=progress.history, steps=progress.step,
                     stopped_early=progress.stopped, out_dir=out_dir)


#: The fields of :class:`SFTConfig` that shape a new model; ``init_from`` takes them from its weights.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads")


def _shape_fields(model_config) -> dict:
    return dict(zip(SHAPE_FIELDS, (model_config.vocab_size, model_config.hidden_size, model_config.num_hidden_layers,
                                   model_config.num_attention_heads, model_config.num_key_value_heads)))


def _unmark_finished(folder: Path) -> None:
    """Remove ``folder``'s ``sft_config.json``, the mark of a finished run, before this run writes
    anything there: a run cut off after that point (its history or weights half replaced) must not leave
    the folder looking like the earlier run's finished one to :func:`train_or_reuse`."""
    (folder / "sft_config.json").unlink(missing_ok=True)


def _weights_digest(folder: str | Path) -> str:
    """The digest of a saved policy's weights (:func:`sinkflex_core.train.policy_digest`)."""
    from .train.evaluate import policy_digest

    return policy_digest(folder)


def _check_writable(folder: Path) -> None:
    """Create ``folder`` and write a file into it, or raise a :class:`ConfigError` saying why not."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"out_dir {str(folder)!r}: cannot write there ({err.strerror or err})") from None


def _task_split(cfg: SFTConfig) -> tuple[list[int], int]:
    """The validation tasks (the last ``cfg.val_tasks`` of the ``"train"`` split) and how many tasks of
    ``cfg.expert_split`` the expert plays (its first ones, never a validation task)."""
    import gymnasium as gym

    import sinkflex_core  # noqa: F401  (registers the environments)

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
    return val_ids, n_train


def _expert_data(cfg: SFTConfig, n_train: int) -> tuple[object, list[dict[str, torch.Tensor]],
                                                         list[dict[str, torch.Tensor]]]:
    """The tokenizer, the expert's episodes of the first ``n_train`` tasks (with ``cfg.opening_copies``
    copies of their openings appended) and the openings (empty where no option needs them)."""
    from . import models
    from .paths import build_dir

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
    return tokenizer, data, openings


def _build_model(cfg: SFTConfig, tokenizer) -> torch.nn.Module:
    """The saved policy of ``cfg.init_from``, or a new tiny model (with previous-token heads where
    ``cfg.previous_token_heads``), in training mode, switched to ``cfg``'s sink attention where it asks
    for it (:meth:`SFTConfig.sink_settings`): before any optimizer exists, so that the learned sink
    logits train with the weights."""
    from . import attention, models

    sinks = cfg.sink_settings()
    if cfg.init_from:
        if sinks is not None:  # an earlier sink-attention stage keeps its learned sink logits
            model = models.load_policy(cfg.init_from, attn_implementation="sdpa").train()
        else:
            from transformers import AutoModelForCausalLM

            if attention.attention_settings(cfg.init_from) is not None:  # as the GRPO trainer refuses it
                raise ConfigError(f"{cfg.init_from} was trained with sink attention; continue it with "
                                  "attention='sinkflex' (its learned sinks are kept), not with full attention")
            model = AutoModelForCausalLM.from_pretrained(cfg.init_from, attn_implementation="sdpa").train()
    else:
        mcfg = models.tiny_qwen2_config(vocab_size=max(cfg.vocab_size, len(tokenizer)), hidden_size=cfg.hidden_size,
                                        num_layers=cfg.num_layers, num_heads=cfg.num_heads or None,
                                        num_kv_heads=cfg.num_kv_heads or None, tokenizer=tokenizer)
        mcfg._attn_implementation = "sdpa"
        model = models.build_model(mcfg, seed=cfg.seed).train()
        if cfg.previous_token_heads:
            models.init_previous_token_heads(model, n_pos=cfg.max_total_tokens)
    if sinks is not None:
        try:
            attention.apply(model, **sinks)
        except ValueError as err:  # e.g. a count per layer of another model
            raise ConfigError(f"sink attention: {err}") from None
    return model


def _save_policy(model: torch.nn.Module, tokenizer, folder: Path) -> None:
    """``save_pretrained`` of the policy and its tokenizer, with its sink attention's settings
    (``attention.save_attention_settings``: :func:`sinkflex_core.models.load_policy` rebuilds it)."""
    from . import attention

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    attention.save_attention_settings(model, folder)


def _prepare(policy: TokenLogprobs, cfg: SFTConfig, tokenizer, data: list[dict[str, torch.Tensor]],
             openings: list[dict[str, torch.Tensor]], val_ids: list[int], rng: np.random.Generator) -> _Ingredients:
    """The drills' tokens, the renaming groups and the value tables, with the warm-ups that use them
    run on ``policy`` as soon as their ingredients exist (copy, recall, identity: the order of the
    recorded runs, whose random draws come from ``rng`` in that order)."""
    # every id but pad and end-of-text (the only two all_special_ids names): the drills, as recorded, also
    # copy the chat tokens and the ~630 reserved ids that the episodes never contain
    special = set(tokenizer.all_special_ids)
    copy_tokens = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    # before the warm-ups (it draws nothing from rng): an action tool the expert never calls is refused at once
    cuts = _action_cuts(cfg, tokenizer, data) if cfg._actions() else None
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
    actions = cfg._actions()
    tables = value_start_tokens(tokenizer) if cfg.value_loss_weight != 1.0 or openings or actions else None
    numbers = number_swap_group(tokenizer) if openings or cfg.swap_numbers else torch.zeros(0, dtype=torch.long)
    # (a tokenizer without such tokens renumbers nothing)
    number_groups = [g for g in [numbers] + ([digit_pair_group(tokenizer)] if cfg.swap_digit_pairs else [])
                     if len(g) >= 2]
    # identity batches are renamed and renumbered: a training user's order id is otherwise a key to
    # remembering their zip code
    identity_groups = swap_groups + number_groups if openings or actions else []
    quotes = quote_tokens(tokenizer) if (openings or actions) and cfg.identity_values == "whole" else None
    short = None
    if cfg.short_action_rows or cfg.short_warmup_steps:
        short = (token_texts(tokenizer), tokenizer.convert_tokens_to_ids(models.IM_START))
    if cfg.identity_warmup_steps:
        identity_warmup(policy, cfg, openings, identity_groups, pad, tables, rng, quotes)
    if cfg.short_warmup_steps:
        short_warmup(policy, cfg, data, cuts, short, identity_groups, pad, tables, rng, quotes)
    number_group = number_groups if cfg.swap_numbers else []
    if number_group:
        sizes = ", ".join(f"{len(g)} {w}-digit tokens" for g, w in zip(number_group, ("three", "two")))
        print(f"sft: renumbering {cfg.swap_numbers:.0%} of the episodes ({sizes})", file=sys.stderr)
    return _Ingredients(tokenizer=tokenizer, data=data, openings=openings, val_ids=val_ids, pad=pad,
                        copy_tokens=copy_tokens, recall=recall, swap_groups=swap_groups, number_group=number_group,
                        identity_groups=identity_groups, tables=tables, quotes=quotes, cuts=cuts, short=short)


def _action_cuts(cfg: SFTConfig, tokenizer, data: list[dict[str, torch.Tensor]]) -> list[tuple[int, int, int, bool]]:
    """The turns the action rows cut after (:func:`action_cuts`): with ``cfg.action_tools``, only the
    calls of those tools (each checked against the tools the expert's episodes call) and the messages."""
    texts = token_texts(tokenizer)
    cuts = action_cuts(data, tokenizer.convert_tokens_to_ids("<tool_call>"), cfg.action_messages)
    names = ["message" if whole else call_name(data[n]["input_ids"][start:end], texts) for n, start, end, whole in cuts]
    tools = {t.strip() for t in cfg.action_tools.split(",") if t.strip()}
    if tools:
        called = {name for name, cut in zip(names, cuts) if not cut[3]}
        if tools - called:
            raise ConfigError(f"action_tools: the expert's episodes never call {sorted(tools - called)} after "
                              f"their first call; they call {sorted(c for c in called if c)}")
        if cfg.action_confirmations:  # a message's name becomes that of the expert's next call, the next cut
            for k in range(len(cuts) - 2, -1, -1):  # that is not a message (every call after the first is a cut)
                if cuts[k][3] and cuts[k + 1][0] == cuts[k][0]:
                    names[k] = names[k + 1]
        keep = [k for k, (cut, name) in enumerate(zip(cuts, names)) if name in tools or
                (cut[3] and not cfg.action_confirmations)]
        cuts, names = [cuts[k] for k in keep], [names[k] for k in keep]
    if not cuts:
        raise RuntimeError("action_rows, short_action_rows: no expert episode calls a second tool")
    kinds = collections.Counter(names).most_common()
    print(f"sft: action rows cut after {len(cuts)} turns ({', '.join(f'{k} {v}' for k, v in kinds)})", file=sys.stderr)
    return cuts


def _lr_at(cfg: SFTConfig, step: int) -> float:
    """The learning rate of optimizer step ``step``: linear warm-up, then cosine decay to
    ``cfg.min_lr_ratio`` of ``cfg.lr`` over ``cfg.schedule_steps`` (default ``cfg.max_steps``)."""
    horizon = cfg.schedule_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    done = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))


def _train_loop(policy: TokenLogprobs, cfg: SFTConfig, kit: _Ingredients, rng: np.random.Generator,
                out_dir: Path | None) -> _Progress:
    """Epochs of length-grouped batches until ``cfg.max_steps``, ``cfg.max_minutes`` or an evaluation
    reaching ``cfg.stop_at_reward``; evaluates every ``cfg.eval_every`` steps and after the last."""
    opt = torch.optim.AdamW(policy.lm.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    lengths = [len(e["input_ids"]) for e in kit.data]
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, desc="sft", unit="step", dynamic_ncols=True, file=sys.stderr)
    progress = _Progress(t0=time.perf_counter())
    done = False
    try:
        while not done:
            for idx in length_batches(lengths, cfg.batch_tokens, rng):
                expert_loss = _optimizer_step(policy, opt, cfg, kit, _expert_batch(cfg, kit, idx, rng), rng, progress)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{expert_loss:.3f}", refresh=False)
                done = progress.step >= cfg.max_steps or (time.perf_counter() - progress.t0) / 60 >= cfg.max_minutes
                if progress.step % cfg.eval_every == 0 or done:
                    if _evaluate(policy.lm, cfg, kit, progress, bar, out_dir):
                        progress.stopped = done = True
                if done:
                    break
            progress.epoch += 1
    finally:
        if bar is not None:
            bar.close()
    return progress


def _expert_batch(cfg: SFTConfig, kit: _Ingredients, idx: list[int], rng: np.random.Generator
                  ) -> dict[str, torch.Tensor]:
    """The expert examples ``idx``, renamed and renumbered at random, collated, with the drill rows
    and the value mask the config asks for."""
    rows = [kit.data[i] for i in idx]
    if cfg.swap_names:
        rows = [swap_names(e, kit.swap_groups, rng) if rng.random() < cfg.swap_names else e for e in rows]
    if kit.number_group:
        rows = [swap_names(e, kit.number_group, rng) if rng.random() < cfg.swap_numbers else e for e in rows]
    batch = collate(rows, kit.pad)
    B, L = batch["input_ids"].shape
    if cfg.copy_fraction:
        batch = add_copy_rows(batch, cfg.copy_fraction, kit.copy_tokens, rng)
    if cfg.recall_fraction:
        batch = add_drill_rows(batch, *recall_rows(cfg, drill_row_count(B, cfg.recall_fraction), L, *kit.recall,
                                                   rng))
    if cfg.value_loss_weight != 1.0:
        batch["value_mask"] = value_start_mask(batch["input_ids"], batch["loss_mask"], *kit.tables)
    return batch


def _optimizer_step(policy: TokenLogprobs, opt: torch.optim.Optimizer, cfg: SFTConfig, kit: _Ingredients,
                    batch: dict[str, torch.Tensor], rng: np.random.Generator, progress: _Progress) -> float:
    """One optimizer step on ``batch`` (plus an identity batch with ``cfg.identity_rows``); adds to
    ``progress``'s step and loss sums. Returns the expert batch's loss."""
    for g in opt.param_groups:
        g["lr"] = _lr_at(cfg, progress.step)
    loss, n = sft_loss(policy, batch, cfg.context_loss_weight, cfg.value_loss_weight)
    expert_loss = loss.item()
    if cfg.identity_rows:
        id_loss, _ = sft_loss(policy, identity_batch(kit.openings, cfg.identity_rows, rng, kit.pad, kit.tables,
                                                     kit.identity_groups, kit.quotes))
        progress.id_sum, progress.id_steps = progress.id_sum + id_loss.item(), progress.id_steps + 1
        loss = loss + id_loss
    if cfg.action_rows:
        act_loss, _ = sft_loss(policy, action_batch(kit.data, kit.cuts, cfg.action_rows, rng, kit.pad, kit.tables,
                                                    kit.identity_groups, kit.quotes))
        loss = loss + act_loss
    if cfg.short_action_rows:
        short_loss, _ = sft_loss(policy, action_batch(kit.data, kit.cuts, cfg.short_action_rows, rng, kit.pad,
                                                      kit.tables, kit.identity_groups, kit.quotes, short=kit.short))
        loss = loss + short_loss
    descend(loss, policy.lm, opt, cfg.grad_clip)
    progress.step += 1
    progress.loss_sum += expert_loss * n
    progress.tok_sum += n
    return expert_loss


def _evaluate(model, cfg: SFTConfig, kit: _Ingredients, progress: _Progress, bar, out_dir: Path | None) -> bool:
    """Play the validation tasks, add a row to ``progress.history`` (and the CSV, and a snapshot where
    asked), keep the weights if they are the best so far. Returns whether the run should stop here."""
    step = progress.step
    ev = evaluate_policy(model, kit.tokenizer, cfg, kit.val_ids, samples=cfg.eval_samples,
                         temperature=cfg.eval_temperature, seed=cfg.seed)
    row = {"step": step, "epoch": progress.epoch, "loss": progress.loss_sum / max(1, progress.tok_sum),
           "lr": _lr_at(cfg, step), "val_reward": ev["reward"], "val_success": ev["success"],
           "val_turns": ev["turns"], "elapsed_s": time.perf_counter() - progress.t0, "best": False}
    if cfg.identity_rows:  # the mean loss of the identity batches since the last evaluation
        row["identity_loss"] = progress.id_sum / max(1, progress.id_steps)
    progress.history.append(row)
    progress.loss_sum, progress.tok_sum, progress.id_sum, progress.id_steps = 0.0, 0, 0.0, 0
    if cfg.keep_best and ev["reward"] >= progress.best_reward:
        progress.best_reward = ev["reward"]
        progress.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        row["best"] = True
    msg = f"sft step {step}: loss {row['loss']:.4f}, validation reward {ev['reward']:.3f}"
    if bar is not None:
        bar.write(msg)
    else:  # without a progress bar the evaluations are still logged
        print(msg, file=sys.stderr)
    if out_dir is not None:
        _unmark_finished(out_dir)
        _write_history(out_dir / "sft_history.csv", progress.history)
        if cfg.save_snapshots:
            _save_policy(model, kit.tokenizer, out_dir / "snapshots" / f"step_{step:06d}")
    return cfg.stop_at_reward > 0 and ev["reward"] >= cfg.stop_at_reward and step >= cfg.min_steps


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


#: The lookup stage (:func:`lookup_stage`): continue a finished SFT run with every lookup of a tool call's
#: values drilled and scored on its own. Recall drills without separators (plain induction from one
#: token: a zip code's last two digits after its first three), 200 steps alone and then a quarter of
#: each batch's rows; the identity call's values scored whole, 300 steps alone and then 8 rows a step;
#: the first token of every value weighted 10 times; every episode renamed and renumbered, the
#: two-digit tokens too, so that no training user's zip code or ids can be remembered; lr 1e-3.
LOOKUP_STAGE = {"recall_warmup_steps": 200, "recall_fact_fillers": 0, "recall_fraction": 0.25,
                "identity_warmup_steps": 300, "identity_rows": 8, "identity_values": "whole",
                "value_loss_weight": 10.0, "swap_numbers": 1.0, "swap_digit_pairs": True,
                "lr": 1e-3, "warmup_steps": 10, "max_steps": 1000, "eval_every": 1000}


def lookup_stage(base_dir: str | Path, out_dir: str | Path, **overrides) -> SFTConfig:
    """The config of the lookup stage: :data:`LOOKUP_STAGE` on top of the saved config of the SFT run in
    ``base_dir`` (``init_from`` it), writing to ``out_dir``; ``overrides`` last. On the command line,
    from the shipped start::

        python -m sinkflex_core.sft --init-from data/retail-tiny-start --recall-warmup-steps 200 \
            --recall-fact-fillers 0 --recall-fraction 0.25 --identity-warmup-steps 300 --identity-rows 8 \
            --identity-values whole --value-loss-weight 10 --swap-numbers 1.0 --swap-digit-pairs \
            --lr 1e-3 --warmup-steps 10 --max-steps 1000 --eval-every 1000 --out-dir runs/start/sft_lookup
    """
    values = saved_config(base_dir)
    values.update(LOOKUP_STAGE, init_from=str(base_dir), out_dir=str(out_dir), **overrides)
    return SFTConfig(**values)


#: The fields of :class:`SFTConfig` that say how a run runs, not what it learns: a finished run is reused
#: whatever they are (:func:`train_or_reuse`), and a recipe passes them to every stage (``start.build``).
RUN_FIELDS = ("threads", "device", "progress")


def train_or_reuse(cfg: SFTConfig) -> Path:
    """Train ``cfg`` into ``cfg.out_dir`` unless that folder already holds a policy trained with the
    same config (:data:`RUN_FIELDS`, ``out_dir`` and ``save_snapshots`` aside; a field the saved
    config lacks, added since, counts as its default); returns the folder."""
    out = Path(cfg.out_dir)

    def key(values: dict) -> dict:
        # with init_from the weights' shape rules (their digest is compared below), not the shape fields
        unused = SHAPE_FIELDS if values.get("init_from") else ()
        return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(SFTConfig(**values)))).items()
                if k not in (*RUN_FIELDS, "out_dir", "save_snapshots", *unused)}

    if (out / "sft_config.json").is_file() and (out / "model.safetensors").is_file():
        if key(saved_config(out)) == key(dataclasses.asdict(cfg)) and _same_inputs(cfg, out):
            print(f"SFT: reusing {out} (same config)", file=sys.stderr, flush=True)
            return out
    print(f"SFT: training -> {out}", file=sys.stderr, flush=True)
    result = train_sft(cfg)
    if result.history:
        last = result.history[-1]
        print(f"SFT: {result.steps} steps, {last['elapsed_s'] / 60:.1f} min, validation reward "
              f"{last['val_reward']:.3f}", file=sys.stderr, flush=True)
    else:
        print(f"SFT: the warm-ups alone (max_steps 0) -> {out}", file=sys.stderr, flush=True)
    return out


def _same_inputs(cfg: SFTConfig, out: Path) -> bool:
    """Whether the finished run in ``out`` was made from what ``cfg``'s paths hold now: the weights of
    ``init_from`` (their digest, recorded since; a run saved before is taken as made from them) and, with
    sink attention, the per-layer sink counts ``layer_sinks`` names (the ones saved with the weights)."""
    from . import attention

    recorded = json.loads((out / "sft_config.json").read_text()).get("init_from_digest")
    if cfg.init_from and recorded and recorded != _weights_digest(cfg.init_from):
        return False
    if cfg.attention == "sinkflex":
        saved = attention.attention_settings(out)
        if saved is None or saved["layer_sinks"] != cfg.sink_counts():
            return False
    return True


#: The columns of ``sft_history.csv`` (one row per evaluation; with identity rows, ``identity_loss`` too).
HISTORY_COLUMNS = ("step", "epoch", "loss", "lr", "val_reward", "val_success", "val_turns", "elapsed_s", "best")


def _write_history(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV; no rows (a run of warm-ups alone): the header of :data:`HISTORY_COLUMNS`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else list(HISTORY_COLUMNS))
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    from .provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
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
