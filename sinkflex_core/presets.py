"""Every preset name of the project: the model shapes and the training runs, one table each.

A **shape** is a model's sizes. Every model here is a Qwen2-architecture decoder built from its shape
by :meth:`Shape.model_config`: the paper's 7B by ``models.qwen25_7b_config`` (its published config),
every other size by the one small-model family, ``models.tiny_qwen2_config``, with the sizes as its
arguments. A shape also carries the memory settings the VRAM harness uses at that size (log-prob
chunk, tiled-MLP slice, sink window)::

    shape         hidden  layers  heads/kv  FFN     vocab    used by
    tiny          256     4       4/2       1,344   16,384   the CPU VRAM harness (notebook 06)
    tiny-policy   128     4       4/2       384     3,072    the SFT start that tiny-cpu trains (1.6M)
    qwen25-1.5b   1,536   28      12/2      8,960   151,936  the GPU harness, full fine-tuning
    qwen25-7b     3,584   28      28/4      18,944  152,064  the paper's policy; the GPU harness

A **run** is a training run: :class:`sinkflex_core.train.TrainConfig` values (``TINY_CPU`` and
``PAPER_8XH100`` in :mod:`sinkflex_core.train.config`, next to the fields they set) and the shape of
the model it trains::

    run           shape         TrainConfig values
    tiny-cpu      tiny-policy   TINY_CPU: the defaults on 2 CPU cores, from the SFT start
    paper-8xh100  qwen25-7b     PAPER_8XH100: 8 GPUs, LoRA, vLLM rollouts, sink attention

Where a user types them: ``sinkflex train --preset RUN`` (``train.resolve_config``, notebook 05,
``TrainConfig.preset``); ``sinkflex bench vram --preset NAME`` (``bench.Settings.preset``, notebook 06,
the ``preset`` column of ``data/vram_*.csv``), where NAME is a shape or a run (a run stands for the
shape of its model). An unknown name is refused with the list of valid ones (training raises
``ConfigError``, a ``ValueError``; :func:`shape` a ``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """A model's sizes and the VRAM harness's memory settings at that size."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    chunk_size: int  # log-prob chunk (tokens)
    slice_tokens: int  # tiled-MLP slice (tokens)
    window: int  # sinkflex window (keys)

    def model_config(self, max_tokens: int = 32768, tokenizer=None):
        """A transformers ``Qwen2Config`` of this shape, without a KV cache, with room for
        ``max_tokens`` positions; ``tokenizer`` (small shapes only) sets the pad and end ids."""
        from . import models

        if self.name == "qwen25-7b":  # the published config, with the hub tokenizer's special ids
            config = models.qwen25_7b_config()
        else:
            config = models.tiny_qwen2_config(vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers,
                                              num_heads=self.heads, num_kv_heads=self.kv_heads,
                                              intermediate_size=self.ffn, tokenizer=tokenizer)
        config.max_position_embeddings = max(int(config.max_position_embeddings), int(max_tokens))
        config.use_cache = False
        return config


SHAPES: dict[str, Shape] = {
    # A CPU-sized stand-in with the same proportions where they matter for memory: vocabulary large
    # against hidden (logits dominate), FFN ~5x hidden, grouped KV heads.
    "tiny": Shape("tiny", hidden=256, layers=4, heads=4, kv_heads=2, ffn=1344, vocab=16384,
                  chunk_size=256, slice_tokens=512, window=256),
    # The tiny policy as sinkflex_core.sft builds it by default (head dimension 32, FFN 3x hidden, the
    # project's 3,072-id tokenizer): the model the tiny-cpu run trains.
    "tiny-policy": Shape("tiny-policy", hidden=128, layers=4, heads=4, kv_heads=2, ffn=384, vocab=3072,
                         chunk_size=256, slice_tokens=512, window=768),
    # Smaller GPU shape for full fine-tuning (weights + grads + AdamW states fit under 80 GiB).
    "qwen25-1.5b": Shape("qwen25-1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936,
                         chunk_size=2048, slice_tokens=8192, window=4096),
    # Qwen2.5-7B's published hyperparameters (its config.json on the Hugging Face Hub); the chunk and
    # window are the paper run's (PAPER_8XH100), so the harness measures the step that run trains.
    "qwen25-7b": Shape("qwen25-7b", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064,
                       chunk_size=2048, slice_tokens=8192, window=4096),
}

# Each training run and the shape of the model it trains; its TrainConfig values are
# sinkflex_core.train.config.PRESETS[run].
RUNS: dict[str, str] = {"tiny-cpu": "tiny-policy", "paper-8xh100": "qwen25-7b"}


def shape(name: str) -> Shape:
    """The shape called ``name``, or the shape of run ``name``'s model."""
    if name not in SHAPES and name not in RUNS:
        raise ValueError(f"unknown preset {name!r}; choose one of {names()}")
    return SHAPES[RUNS.get(name, name)]


def names() -> list[str]:
    """Every name ``shape`` accepts (``sinkflex bench vram --preset``), sorted."""
    return sorted([*SHAPES, *RUNS])
