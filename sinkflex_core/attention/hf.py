"""Hugging Face integration: the ``"sinkflex"`` attention implementation (its mask function and
forward, registered with transformers), :func:`apply` to a loaded causal LM, the learnable sink
logits, and the settings saved beside a policy so that it loads with the attention it was trained
with."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from .kernels import DEFAULT_CHUNK, sink_attention
from .masks import (
    DEFAULT_N_SINK,
    DEFAULT_WINDOW,
    SinkFlexMask,
    _boundaries_to_layout,
    _check_count,
    document_starts,
)

IMPLEMENTATION = "sinkflex"
SINKS_FILENAME = "sinkflex_sinks.json"
SETTINGS_FILENAME = "sinkflex_attention.json"
# Initial sink logit s0. Each attention output row is scaled by 1 - eps, eps = sigmoid(s0 - lse) <=
# exp(s0 - lse): with s0 = -10 that is <= 4.5e-5 for every row whose log-sum-exp is >= 0 (a row with any
# non-negative score, or log(n_keys) above its mean score), and ~4.5e-5 / n_keys for near-uniform rows.
# Far more negative values (-16) leave the outputs even closer but make the gradient (~eps) fall below
# Adam's epsilon (1e-8), so the sinks would not learn.
DEFAULT_SINK_LOGIT = -10.0


def sinkflex_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
) -> SinkFlexMask:
    """Mask function for ``transformers.AttentionMaskInterface``: turns what ``create_causal_mask``
    passes (a causal mask_function, possibly AND-ed with Hugging Face's packed-sequence mask, and a 2D
    padding mask (B, kv_length)) into a :class:`SinkFlexMask` that every layer shares.

    Document boundaries are read from ``mask_function`` on adjacent positions only (position ``p``
    continues the document of ``p - 1`` iff ``mask_function(p, p - 1)`` holds), so no L x L mask is
    evaluated. Other overlays Hugging Face may add (e.g. bidirectional blocks) are
    not carried over. With a static cache (``generate(..., cache_implementation="static")``) the keys are
    the whole preallocated cache and the padding mask covers only the tokens seen so far; the slots
    after them count as padding.
    """
    q_offset = int(q_offset)
    valid = None
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)[:, -kv_length:]
        if valid.dim() == 2 and valid.shape[0] == batch_size and valid.shape[1] < kv_length:
            # a static cache: keys are the whole preallocated buffer, the mask covers the tokens seen so
            # far, and the slots after them are not written yet (causality hides them too)
            valid = torch.nn.functional.pad(valid, (0, kv_length - valid.shape[1]), value=False)
        if valid.shape != (batch_size, kv_length):
            raise ValueError(f"padding mask must be (batch, kv_length)={batch_size, kv_length}, "
                             f"got {tuple(valid.shape)}")
    continues = None
    if mask_function is not None and kv_length > 1:
        # breaks between adjacent positions, then: a token continues the previous real one when no break
        # lies between them (a padding run between the two is not a break of its own)
        b = torch.arange(batch_size, device=device)[:, None]
        p = torch.arange(kv_offset + 1, kv_offset + kv_length, device=device)[None, :]
        joined = mask_function(b, torch.zeros((), dtype=torch.long, device=device), p, p - 1)
        breaks = torch.zeros(batch_size, kv_length, dtype=torch.long, device=device)
        breaks[:, 1:] = (~torch.as_tensor(joined, device=device)).expand(batch_size, kv_length - 1).long()
        count = breaks.cumsum(-1)

        def continues(prev):
            return count == count.gather(1, prev)

    all_real = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    is_start = document_starts(all_real if valid is None else valid, continues)
    packed = bool(is_start[:, 1:].any())
    ids, start = _boundaries_to_layout(is_start) if packed else (None, None)
    if valid is not None and bool(valid.all()):
        valid = None
    return SinkFlexMask(
        batch_size,
        q_length,
        kv_length,
        q_offset - kv_offset,
        ids,
        start,
        valid,
        device,
        keys_dropped=int(kv_offset),
    )


_NO_SETTINGS = object()


def _layer_settings(module: nn.Module) -> tuple[int, int | None]:
    """(n_sink, window) of one attention layer: set by :func:`apply`, else read from the config
    (``sinkflex_n_sink`` or ``sinkflex_layer_sinks``, and ``sinkflex_window``). There is no silent
    default: a model switched to ``"sinkflex"`` with neither gets a ValueError that says what to do."""
    cfg = getattr(module, "config", None)
    n_sink = getattr(module, "sinkflex_n_sink", None)
    if n_sink is None:
        per_layer = getattr(cfg, "sinkflex_layer_sinks", None)
        layer = getattr(module, "layer_idx", None)
        if per_layer is not None and layer is not None:
            n_sink = per_layer[layer]
        else:
            n_sink = getattr(cfg, "sinkflex_n_sink", None)
    window = getattr(module, "sinkflex_window", getattr(cfg, "sinkflex_window", _NO_SETTINGS))
    if n_sink is None or window is _NO_SETTINGS:
        raise ValueError(
            f"attn_implementation='{IMPLEMENTATION}' but layer {getattr(module, 'layer_idx', '?')} has no sink "
            "settings: call sinkflex_core.attention.apply(model, n_sink=..., window=...) (it also adds the "
            "learned sinks), or load a saved policy with sinkflex_core.models.load_policy(folder)")
    return _check_count("n_sink", n_sink, 0), None if window is None else _check_count("window", window, 1)


def sinkflex_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: SinkFlexMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention function for ``transformers.AttentionInterface``.

    query (B, H, Lq, D), key/value (B, Hkv, Lk, D) -> (B, Lq, H, D). The layer's sink count and window
    come from the module (set by :func:`apply`) or the config (``sinkflex_n_sink``, ``sinkflex_window``,
    ``sinkflex_layer_sinks``), the window capped by the layer's own ``sliding_window`` if it has one; the
    sink logits from the module's ``sinkflex_sink_logits`` or, for models that already have sinks
    (gpt-oss), from ``s_aux``. ``attention_mask`` is the batch's :class:`SinkFlexMask`, built by
    :func:`sinkflex_mask` or passed by the caller as ``attention_mask={"full_attention": mask}``.
    """
    if dropout and module.training:
        raise NotImplementedError("sinkflex attention has no attention dropout; set attention_dropout=0")
    if attention_mask is None:
        attention_mask = SinkFlexMask.causal(query.shape[0], query.shape[2], key.shape[2], device=query.device)
    elif not isinstance(attention_mask, SinkFlexMask):
        raise TypeError(
            "sinkflex attention needs the mask built by its own mask function (got "
            f"{type(attention_mask).__name__}); call sinkflex_core.attention.register() before the model runs"
        )
    n_sink, window = _layer_settings(module)
    if getattr(getattr(module, "config", None), "sinkflex_learn_sinks", False) and \
            getattr(module, "sinkflex_sink_logits", None) is None:
        raise ValueError(
            f"this model was trained with learned sink logits, which layer {getattr(module, 'layer_idx', '?')} "
            "lacks (from_pretrained drops them): load it with sinkflex_core.models.load_policy(folder), or "
            "call attention.apply(model, ...) then attention.load_sink_logits(model, folder)")
    if n_sink and attention_mask.keys_dropped:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: {n_sink} sink tokens, but the cache has "
                         f"evicted the first {attention_mask.keys_dropped} keys (a sliding-window cache layer); "
                         "generate with a cache that keeps every key, or with n_sink=0 on sliding layers")
    own_window = kwargs.get("sliding_window")
    if own_window:
        # layers that are sliding-window by design (gpt-oss, Mistral-style) keep at most their own window
        window = own_window if window is None else min(window, own_window)
    sinks = getattr(module, "sinkflex_sink_logits", None)
    if sinks is None:
        sinks = s_aux
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # as autocast runs torch's own attention: q, k and v in its dtype (rotary embeddings return q and k
        # in float32, the value projection gives the autocast dtype)
        low = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(low), key.to(low), value.to(low)
    out = sink_attention(
        query,
        key,
        value,
        attention_mask,
        n_sink=n_sink,
        window=window,
        sink_logits=sinks,
        scale=scaling,
        backend=getattr(module, "sinkflex_backend", "auto"),
        chunk_size=getattr(module, "sinkflex_chunk_size", DEFAULT_CHUNK),
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``attn_implementation="sinkflex"`` (attention and mask) with transformers; idempotent."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from .sinks import PROBE_IMPLEMENTATION, _probe_attention_forward

    AttentionInterface.register(IMPLEMENTATION, sinkflex_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sinkflex_mask)
    AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention_forward)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, sinkflex_mask)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    mods = [
        m
        for m in model.modules()
        if "Attention" in type(m).__name__ and hasattr(m, "layer_idx") and hasattr(m, "o_proj")
    ]
    if not mods:
        raise ValueError(f"no attention layers (with layer_idx and o_proj) found in {type(model).__name__}")
    return mods


def _set_implementation(model: nn.Module, name: str) -> None:
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def apply(
    model: nn.Module,
    n_sink: int = DEFAULT_N_SINK,
    window: int | None = DEFAULT_WINDOW,
    learn_sinks: bool = True,
    *,
    layer_sinks: Sequence[int] | str | os.PathLike | None = None,
    sink_init: float = DEFAULT_SINK_LOGIT,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
) -> nn.Module:
    """Switch a Hugging Face causal LM (Qwen2, Llama, ...) to sink-aware attention, in place.

    Every attention layer keeps ``n_sink`` sink tokens per document plus a window of ``window`` keys
    (counting the query); ``window=None`` keeps full causal attention. ``layer_sinks`` (a list with one
    count per layer, or a JSON file / model folder written by :func:`save_layer_sinks`) overrides
    ``n_sink`` layer by layer. ``learn_sinks`` adds a float32 parameter ``sinkflex_sink_logits`` (H,)
    to every attention layer, initialised at ``sink_init`` so that outputs are unchanged (see
    ``DEFAULT_SINK_LOGIT``), or at the layer's own trained sink logits where it has them (gpt-oss). Call it before wrapping the model with peft; :func:`sink_parameters` lists
    the new parameters (to keep them trainable next to LoRA). Returns the model.
    """
    register()
    window = None if window is None else _check_count("window", window, 1)
    n_sink = _check_count("n_sink", n_sink, 0)
    chunk_size = _check_count("chunk_size", chunk_size, 1)
    mods = _attention_modules(model)
    if isinstance(layer_sinks, str | os.PathLike):  # a str is a Sequence too: test the path types first
        from .sinks import load_layer_sinks

        layer_sinks = load_layer_sinks(layer_sinks)
    if layer_sinks is not None and len(layer_sinks) != len(mods):
        raise ValueError(f"layer_sinks has {len(layer_sinks)} entries for {len(mods)} attention layers")
    if layer_sinks is not None:
        layer_sinks = [_check_count("layer_sinks entry", x, 0) for x in layer_sinks]
    cfg = model.config
    n_heads = cfg.num_attention_heads
    for m in mods:
        m.sinkflex_n_sink = int(layer_sinks[m.layer_idx]) if layer_sinks is not None else int(n_sink)
        m.sinkflex_window = window
        m.sinkflex_backend = backend
        m.sinkflex_chunk_size = chunk_size
        if learn_sinks and not hasattr(m, "sinkflex_sink_logits"):
            dev = m.o_proj.weight.device
            own = getattr(m, "sinks", None)  # gpt-oss's trained sink logits: start from them, not from sink_init
            init = (own.detach().float().clone() if isinstance(own, torch.Tensor) and own.shape == (n_heads,)
                    else torch.full((n_heads,), float(sink_init), dtype=torch.float32, device=dev))
            m.register_parameter("sinkflex_sink_logits", nn.Parameter(init))
    cfg.sinkflex_n_sink = n_sink
    cfg.sinkflex_window = window
    cfg.sinkflex_layer_sinks = None if layer_sinks is None else [int(x) for x in layer_sinks]
    # saved with the config: a model loaded without its learned sinks then refuses to run (see
    # sinkflex_attention_forward) instead of running a different attention
    cfg.sinkflex_learn_sinks = any(hasattr(m, "sinkflex_sink_logits") for m in mods)
    _set_implementation(model, IMPLEMENTATION)
    return model


def remove(model: nn.Module, implementation: str = "sdpa") -> nn.Module:
    """Undo :func:`apply`, in place: every attention layer back to full causal attention on
    ``implementation`` (transformers' name: ``"sdpa"``, ``"eager"``, ...), its learned sink logits
    deleted and the ``sinkflex_*`` entries of the config cleared, so that a model saved afterwards
    loads as a plain one. This plays a policy trained with sink attention with the same weights under
    full attention: a *different* model (the learned zero-value sink and the window are gone), to
    compare with, not to stand in for, the one that was trained. Call it before wrapping the model
    with peft. Returns the model; a model without sink attention is returned as it is."""
    if implementation == IMPLEMENTATION:
        raise ValueError(f"remove() switches to another attention than {IMPLEMENTATION!r}: name one, e.g. 'sdpa'")
    cfg = model.config
    if getattr(cfg, "sinkflex_n_sink", None) is None and not sink_parameters(model):
        return model
    for m in _attention_modules(model):
        for name in ("sinkflex_n_sink", "sinkflex_window", "sinkflex_backend", "sinkflex_chunk_size"):
            if hasattr(m, name):
                delattr(m, name)
        if "sinkflex_sink_logits" in m._parameters:
            del m._parameters["sinkflex_sink_logits"]
    for name in ("sinkflex_n_sink", "sinkflex_window", "sinkflex_layer_sinks", "sinkflex_learn_sinks"):
        if hasattr(cfg, name):
            delattr(cfg, name)
    _set_implementation(model, implementation)
    return model


def sink_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sink-logit parameters added by :func:`apply` (one (H,) tensor per layer)."""
    return [p for n, p in model.named_parameters() if n.endswith("sinkflex_sink_logits")]


def load_sink_logits(model: nn.Module, model_dir: str | os.PathLike) -> int:
    """Copy the sink logits saved by ``save_pretrained`` (``*.safetensors`` in ``model_dir``) into a model
    switched by :func:`apply` (``from_pretrained`` drops them as unknown keys). Returns how many tensors
    were loaded; raises if the folder holds none or if one has no matching parameter."""
    from safetensors import safe_open

    params = {n.split("sinkflex_sink_logits")[0]: p for n, p in model.named_parameters()
              if n.endswith("sinkflex_sink_logits")}
    loaded = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if not key.endswith("sinkflex_sink_logits"):
                    continue
                prefix = key.split("sinkflex_sink_logits")[0]
                # saved names may lack or add a wrapper prefix (peft's base_model.model., ...)
                match = [p for n, p in params.items() if n.endswith(prefix) or prefix.endswith(n)]
                if len(match) != 1:
                    raise KeyError(f"no unique sink-logit parameter for {key} (call apply(..., learn_sinks=True) first)")
                with torch.no_grad():
                    match[0].copy_(f.get_tensor(key).to(match[0].dtype))
                loaded += 1
    if loaded == 0:
        raise FileNotFoundError(f"no sink logits in the safetensors files of {model_dir}")
    return loaded


def _saved_sink_logit_files(folder: Path) -> list[Path]:
    from safetensors import safe_open

    found = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if any(k.endswith("sinkflex_sink_logits") for k in f.keys()):
                found.append(file)
    return found


def attention_settings(source: nn.Module | str | os.PathLike) -> dict | None:
    """The sink attention a model runs with, or that a saved model folder was trained with: a dict
    ``{"n_sink", "window", "layer_sinks", "learn_sinks"}``, or None for a model without sink attention.

    A folder is read from ``sinkflex_attention.json`` (written by :func:`save_attention_settings`, the only
    record beside LoRA adapters) or else from the ``sinkflex_*`` entries :func:`apply` put in its
    ``config.json``; ``learn_sinks`` then says whether its safetensors files hold learned sink logits."""
    if isinstance(source, nn.Module):
        cfg = getattr(source, "config", None)
        if cfg is None or getattr(cfg, "sinkflex_n_sink", None) is None:
            return None
        return {"n_sink": cfg.sinkflex_n_sink, "window": getattr(cfg, "sinkflex_window", None),
                "layer_sinks": getattr(cfg, "sinkflex_layer_sinks", None),
                "learn_sinks": bool(sink_parameters(source))}
    folder = Path(source)
    saved = folder / SETTINGS_FILENAME
    if saved.is_file():
        data = _json_object(saved)
        if "n_sink" not in data:
            raise ValueError(f"{saved} names no 'n_sink' (the sink tokens of every layer)")
    elif (folder / "config.json").is_file():
        cfg = _json_object(folder / "config.json")
        if cfg.get("sinkflex_n_sink") is None:
            return None
        data = {"n_sink": cfg["sinkflex_n_sink"], "window": cfg.get("sinkflex_window"),
                "layer_sinks": cfg.get("sinkflex_layer_sinks")}
    else:
        return None
    data = {k: data.get(k) for k in ("n_sink", "window", "layer_sinks")}
    window, layers = data["window"], data["layer_sinks"]
    if not (_is_count(data["n_sink"]) and (window is None or _is_count(window) and window >= 1)
            and (layers is None or isinstance(layers, list) and all(_is_count(x) for x in layers))):
        raise ValueError(f"the sink attention recorded in {saved if saved.is_file() else folder / 'config.json'} "
                         f"is not valid: n_sink must be an integer >= 0, window an integer >= 1 or null (full "
                         f"attention after the sinks), layer_sinks a list of integers >= 0 or null; got {data}")
    data["learn_sinks"] = bool(_saved_sink_logit_files(folder))
    return data


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def save_attention_settings(model: nn.Module, folder: str | os.PathLike) -> Path | None:
    """Write ``sinkflex_attention.json`` (sink counts and window of a model switched by :func:`apply`)
    into ``folder``, so that :func:`sinkflex_core.models.load_policy` rebuilds the attention even where
    no ``config.json`` is saved (LoRA adapters). Returns the path, or None for a model without sinks,
    whose folder then loses any such file an earlier run left there (it is read before ``config.json``:
    a stale one would load the new full-attention weights with the old run's sinks and window)."""
    settings = attention_settings(model)
    path = Path(folder) / SETTINGS_FILENAME
    if settings is None:
        path.unlink(missing_ok=True)
        return None
    path.write_text(json.dumps({"format": "sinkflex-attention/1", **settings}, indent=1))
    return path


