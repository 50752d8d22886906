"""The policy: building it (a tiny random Qwen2 or ``from_pretrained``, with the chosen attention,
LoRA, gradient checkpointing and MLP tiling) and the one forward that returns per-token log-probs,
which the trainer, the reference model, the SFT recipe and the memory harness all call."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

from .config import ConfigError, TrainConfig


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class TokenLogprobs(nn.Module):
    """A causal LM whose forward returns per-token log-probs and entropies, aligned with the input.

    ``forward(input_ids (B, L), attention_mask (B, L), position_ids (B, L))`` ->
    ``(logp (B, L), entropy (B, L))`` float32 with ``logp[:, t] = log p(input_ids[:, t] | prefix)`` and
    column 0 set to 0. Logits are divided by ``temperature`` (the distribution the rollout sampled
    from). With ``chunk_size > 0`` the full-vocabulary logits never exist at once
    (:func:`sinkflex_core.grpo.token_logprobs`); else the plain path (all logits in float32).

    Being one module matters for FSDP2: the root wrapper all-gathers the embedding, final norm and
    output layer for the whole forward, including the log-prob head that reads ``lm_head.weight``.

    ``autocast_dtype`` (e.g. ``torch.bfloat16``): the decoder runs under ``torch.autocast`` with it
    (its matrix products in that dtype; the weights, their gradients and the log-prob head stay in the
    weights' dtype)."""

    def __init__(self, lm: nn.Module, chunk_size: int = 0, temperature: float = 1.0, entropy_grad: bool = False,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.lm = lm
        self.chunk_size = int(chunk_size)
        self.temperature = float(temperature)
        self.entropy_grad = bool(entropy_grad)
        self.autocast_dtype = autocast_dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from .. import grpo

        causal = causal_lm(self.lm)
        with torch.autocast(input_ids.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            out = causal.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False)
        hidden = out.last_hidden_state
        weight = causal.get_output_embeddings().weight
        if self.temperature != 1.0:
            hidden = hidden / self.temperature
        if hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)
        if self.chunk_size > 0:
            return grpo.causal_token_logprobs(hidden, weight, input_ids, chunk_size=self.chunk_size,
                                              entropy_grad=self.entropy_grad)
        logp, ent = grpo.naive_token_logprobs(hidden[:, :-1], weight, input_ids[:, 1:])
        if not self.entropy_grad:
            ent = ent.detach()
        return nn.functional.pad(logp, (1, 0)), nn.functional.pad(ent, (1, 0))


def load_tokenizer(cfg: TrainConfig):
    from .. import models

    if cfg.tokenizer == "auto":
        if cfg.model == "tiny":
            return models.get_tokenizer(cfg.vocab_size)
        if Path(cfg.model, "tokenizer.json").is_file() or Path(cfg.model, "tokenizer_config.json").is_file():
            return _auto_tokenizer(cfg.model)
        if Path(cfg.model).is_dir():  # a tiny policy saved without its tokenizer
            return models.get_tokenizer(cfg.vocab_size)
        return _auto_tokenizer(cfg.model)
    if cfg.tokenizer == "tiny":
        return models.get_tokenizer(cfg.vocab_size)
    return _auto_tokenizer(cfg.tokenizer)


def _auto_tokenizer(name: str):
    from .. import models

    try:
        return models.load_tokenizer(name)
    except OSError as err:
        raise ConfigError(f"cannot load a tokenizer from {name!r}: {err}") from None


def load_model(cfg: TrainConfig, tokenizer, device: torch.device, model_config=None) -> nn.Module:
    """The policy before any wrapper: tiny random Qwen2, or ``from_pretrained(cfg.model)``, with the
    chosen attention, LoRA, gradient checkpointing and MLP tiling applied. ``model_config``, a
    transformers config, replaces ``cfg.model``: that shape with random weights drawn from ``cfg.seed``,
    built on ``device`` in ``cfg.dtype`` (the memory harness's models; nothing is downloaded)."""
    from .. import models

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    attn = {"sinkflex": "sdpa", "flex": "flex_attention"}.get(cfg.attention, cfg.attention)
    if model_config is not None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(model_config, dtype=dtype, attn_implementation=attn)
    elif cfg.model == "tiny":
        mcfg = models.tiny_qwen2_config(vocab_size=max(cfg.vocab_size, len(tokenizer)), hidden_size=cfg.hidden_size,
                                        num_layers=cfg.num_layers, tokenizer=tokenizer)
        mcfg._attn_implementation = attn
        model = models.build_model(mcfg, seed=cfg.seed)
    else:
        from transformers import AutoModelForCausalLM

        # The paper preset: Qwen2.5-7B-Instruct from the hub (or a local folder, e.g. an SFT output).
        # FSDP keeps float32 master weights when training in bfloat16 (see shard_policy), so the
        # weights are loaded in float32 there; a single process loads them in the compute dtype.
        load_dtype = torch.float32 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else dtype
        if not cfg.saved_attention and not Path(cfg.model).is_dir():
            raise ConfigError(f"{cfg.model} is not a saved folder: saved_attention=false changes nothing")
        try:
            if Path(cfg.model).is_dir():  # a saved policy: with the attention it was trained with (by default)
                model = models.load_policy(cfg.model, dtype=load_dtype, attn_implementation=attn,
                                           saved_attention=cfg.saved_attention)
            else:
                model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=load_dtype, attn_implementation=attn)
        except OSError as err:
            raise ConfigError(f"cannot load model {cfg.model!r}: {err}") from None
        except ValueError as err:  # load_policy's refusals (saved_attention=false on a full-attention folder)
            raise ConfigError(str(err)) from None
        if cfg.attention != "sinkflex" and getattr(model.config, "_attn_implementation", None) == "sinkflex":
            raise ConfigError(f"{cfg.model} was trained with sink attention; train it with attention=sinkflex "
                              "(its learned sinks are kept), or start from its weights with full attention with "
                              "saved_attention=false")
    if cfg.attention == "sinkflex":
        from .. import attention
        from .layer_sinks import resolve_layer_sinks

        trained = attention.attention_settings(model)  # a saved policy's own, loaded with it
        try:
            attention.apply(model, n_sink=cfg.n_sink, window=cfg.window, learn_sinks=cfg.learn_sinks,
                            layer_sinks=resolve_layer_sinks(cfg, model, tokenizer))
        except ValueError as err:  # a count file that is broken or made for another model
            raise ConfigError(f"sink attention: {err}") from None
        _say_attention_changes(cfg, trained, attention.attention_settings(model), model.config.num_hidden_layers)
    if cfg.tile_mlp_tokens:
        from .. import memory

        memory.tile_mlp(model, slice_tokens=cfg.tile_mlp_tokens)
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        sinks = [n for n, _ in model.named_parameters() if n.endswith("sinkflex_sink_logits")]
        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                 lora_dropout=cfg.lora_dropout,
                                                 target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM"))
        # peft freezes everything but the adapters; the learned sink logits stay trainable.
        for name, p in model.named_parameters():
            if any(name.endswith(s) for s in sinks):
                p.requires_grad_(True)
    if cfg.gradient_checkpointing:
        causal_lm(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora:  # the embeddings are frozen: inputs need grad for checkpointed blocks to backprop
            causal_lm(model).enable_input_require_grads()
    if model_config is not None or cfg.model == "tiny" or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        model = model.to(device)
        if dtype != torch.float32:
            sink_ids = {id(p) for n, p in model.named_parameters() if n.endswith("sinkflex_sink_logits")}
            for p in model.parameters():
                if id(p) not in sink_ids:
                    p.data = p.data.to(dtype)
    return model


def _say_attention_changes(cfg: TrainConfig, trained: dict | None, now: dict, n_layers: int) -> None:
    """The run's sink attention wins over the one its start was trained with (a run may study another
    window), but not silently: a preset's window replacing the start's would change the policy."""
    if trained is None or int(os.environ.get("RANK", "0")) != 0:
        return

    def sinks(settings: dict) -> list[int]:  # one count in every layer, or the layer-by-layer counts
        return list(settings["layer_sinks"] or [settings["n_sink"]] * n_layers)

    changes = [f"window {trained['window']} -> {now['window']}"] if trained["window"] != now["window"] else []
    if sinks(trained) != sinks(now):
        changes.append(f"sink tokens per layer {sinks(trained)} -> {sinks(now)}")
    if trained["learn_sinks"] and not cfg.learn_sinks:
        changes.append("its learned sink logits are kept (learn_sinks=false adds none, it removes none)")
    if changes:
        print(f"note: {cfg.model} was trained with other sink attention than this run's: {'; '.join(changes)}",
              file=sys.stderr, flush=True)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
