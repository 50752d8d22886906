"""Per-layer sink counts of a run (``TrainConfig.layer_sinks``): read from a file, taken from the start
policy, or estimated on it from the retail oracle's episodes, and recorded in the run folder.

    counts = resolve_layer_sinks(cfg, model, tokenizer)    # None: n_sink in every layer
    attention.apply(model, n_sink=cfg.n_sink, window=cfg.window, layer_sinks=counts)

Why per layer: layers differ in how much attention they park on the first tokens of a document (some
put a third of it on token 0, some spread it), and a layer whose sink mass falls outside its kept
keys loses it to the window. :func:`sinkflex_core.attention.estimate_layer_sinks` measures that mass
with the model's own full attention and keeps, per layer, the prefix that holds it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..paths import write_text_atomic
from .config import ConfigError, TrainConfig, rollout_config

# Calibration rows are cut to one length (the estimator takes (B, L) without padding); the first
# 1,024 tokens of an episode hold the system prompt, the identity lookup and a few tool calls.
CALIBRATION_TOKENS = 1024


def expert_calibration_ids(cfg: TrainConfig, tokenizer, episodes: int | None = None,
                           max_tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """(B, L) token ids of the retail oracle's episodes on the first ``episodes`` training tasks, with
    the run's prompt and chat template, each cut to the shortest of them (at most ``max_tokens``)."""
    from ..rollout import AgentBackend, collect_rollouts

    n = episodes or cfg.layer_sinks_episodes
    rcfg = rollout_config(cfg, seed=cfg.seed, group_size=1)
    batch = collect_rollouts(AgentBackend(tokenizer), tokenizer, cfg.env_id, list(range(n)), cfg.train_split, rcfg)
    rows = [batch.input_ids[i][batch.attention_mask[i].bool()] for i in range(len(batch))]
    length = min(min(len(r) for r in rows), max_tokens)
    return torch.stack([r[:length] for r in rows])


def _start_policy_counts(model_dir: str) -> list[int] | None:
    """The counts a saved start policy carries: its ``sinkflex_sinks.json``, else the per-layer counts of
    the sink attention it was trained with; None if it has neither."""
    from .. import attention

    folder = Path(model_dir)
    if not folder.is_dir():
        return None
    if (folder / attention.SINKS_FILENAME).is_file():
        return attention.load_layer_sinks(folder)
    settings = attention.attention_settings(folder)
    return list(settings["layer_sinks"]) if settings and settings.get("layer_sinks") else None


def resolve_layer_sinks(cfg: TrainConfig, model: nn.Module, tokenizer) -> list[int] | None:
    """The per-layer sink counts ``cfg`` asks for, for ``model`` (the start policy, before
    ``attention.apply``); None for one count in every layer (``layer_sinks=""`` or no sink attention).

    ``"auto"``: ``out_dir/sinkflex_sinks.json`` when resuming (a resumed run keeps its counts), else the
    start policy's own counts (unless ``saved_attention`` is false), else
    :func:`sinkflex_core.attention.estimate_layer_sinks` on :func:`expert_calibration_ids` (at least
    ``n_sink`` and at most 16 per layer); what it chose is written to ``out_dir/sinkflex_sinks.json``."""
    from .. import attention

    spec = cfg.layer_sinks
    if cfg.attention != "sinkflex" or not spec:
        return None
    if spec != "auto":
        try:
            return attention.load_layer_sinks(spec)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"layer_sinks: {err}") from None
    record = Path(cfg.out_dir) / attention.SINKS_FILENAME
    if cfg.resume and record.is_file():
        return attention.load_layer_sinks(record)
    counts = None if cfg.model == "tiny" or not cfg.saved_attention else _start_policy_counts(cfg.model)
    if counts is not None:
        data = {"format": "sinkflex-layer-sinks/1", "n_sink": counts, "source": f"the start policy {cfg.model}"}
    else:
        if tokenizer is None:
            raise ConfigError('layer_sinks="auto" estimates the counts on expert episodes, which needs the tokenizer')
        ids = expert_calibration_ids(cfg, tokenizer)
        # n_sink is every layer's floor: a start without emergent sinks keeps the usual few, and a layer
        # that parks attention further in keeps more
        estimate = attention.estimate_layer_sinks(model, ids, min_sinks=cfg.n_sink, max_sinks=max(16, cfg.n_sink))
        data = {**estimate.to_json(), "source": f"estimated on {cfg.model}: {ids.shape[0]} expert episodes of "
                                                f"{cfg.env_id} ({cfg.train_split}), {ids.shape[1]} tokens each"}
    if int(os.environ.get("RANK", "0")) == 0:  # every rank computes the same counts; one writes them
        record.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: a rank that starts later with resume=True reads this file
        write_text_atomic(record, json.dumps(data, indent=1) + "\n")
    return [int(x) for x in data["n_sink"]]
