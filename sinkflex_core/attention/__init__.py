"""Sink-aware attention: sink tokens + sliding window masks, the learnable zero-value sink, a fused CPU
path, an exact chunked PyTorch path, a float64 reference, Hugging Face registration and per-layer sink
estimation.

The attention computed here, for query ``i`` and key ``j`` of one row (keys indexed in the row):

* ``j`` is visible when ``j <= i`` (causal), ``j`` and ``i`` lie in the same document (packed rows),
  ``j`` is not padding, and either ``j`` is one of the first ``n_sink`` tokens of its document or
  ``i - j < window``. The window therefore holds ``window`` keys **counting the query itself**: keys
  ``i - window + 1 .. i`` (the same convention as Hugging Face's ``sliding_window``). Padding is not a
  token: sinks and window count real tokens only, and only the first real token of a row (or a real
  change of document: a new segment id, a position that does not continue) starts a document, so a
  row padded in the middle (a batch of turns of different lengths) attends as it would alone.
* With sink logits ``s`` (one per query head) the softmax gets one extra term ``exp(s)`` that carries no
  value vector. Since ``softmax`` over ``[scores, s]`` with the last column dropped equals the plain
  softmax times ``Z / (Z + e^s)``, the output is ``out * sigmoid(lse - s)`` with ``lse`` the
  log-sum-exp of the visible scores; it is applied in float32.

Three backends compute the same numbers: FlexAttention (block-sparse, used on CUDA, compiled); on CPU,
where FlexAttention has no backward, PyTorch's fused attention kernel under an additive mask, one block
of queries at a time against only the keys the block can see (the kernel knows no sink: its output is
gated as above, and its backward is handed the gated output and the log-sum-exp with the sink, which
makes its gradients those of the sink softmax; the sink logits' gradient is added by hand), used while
the ``B x L x L`` mask would be small (``kernels.DENSE_MASK_LIMIT``); and beyond that an exact chunked
path in plain PyTorch (queries in chunks against only the keys they can see; a custom backward
recomputes each chunk from the saved log-sum-exp). Only the fused path holds mask entries (each query
block's rows over its keys; the kernel itself works block by block); FlexAttention builds none when
compiled, as on CUDA (its uncompiled CPU fallback is for checks). GQA is handled by FlexAttention's
``enable_gqa``, by repeating K and V for the fused kernel, and, in the chunked path, by folding the query
heads of one KV head into the query rows.

Use::

    from sinkflex_core import attention
    attention.apply(model, n_sink=4, window=4096, learn_sinks=True)      # a loaded HF causal LM
    # or: from_pretrained(..., attn_implementation="sinkflex") after importing this module
    est = attention.estimate_layer_sinks(model, calibration_ids)        # per-layer sink counts
    attention.save_layer_sinks(est, model_dir)                          # model_dir/sinkflex_sinks.json
    attention.apply(model, window=4096, layer_sinks=model_dir)
    attention.remove(model)                      # back to full attention (sinks and window dropped)

The modules: ``masks`` (the ``mask_mod`` functions and :class:`SinkFlexMask`), ``kernels`` (the
zero-value sink, FlexAttention, the fused and chunked CPU paths, the reference), ``hf`` (registration
with transformers, :func:`apply` and :func:`remove`, sink logits and saved settings) and ``sinks``
(per-layer sink estimation).
"""

from . import hf, kernels, masks, sinks
from .hf import (
    DEFAULT_SINK_LOGIT,
    IMPLEMENTATION,
    SETTINGS_FILENAME,
    SINKS_FILENAME,
    _attention_modules,
    _layer_settings,
    _set_implementation,
    apply,
    attention_settings,
    load_sink_logits,
    register,
    remove,
    save_attention_settings,
    sink_parameters,
    sinkflex_attention_forward,
    sinkflex_mask,
)
from .kernels import DEFAULT_CHUNK, _ChunkPlan, apply_zero_value_sink, reference_attention, sink_attention
from .masks import (
    DEFAULT_N_SINK,
    DEFAULT_WINDOW,
    MaskMod,
    SinkFlexMask,
    causal_mask,
    document_mask,
    document_starts,
    key_padding_mask,
    sink_token_mask,
    sink_window_mask,
    sliding_window_mask,
)
from .sinks import (
    PROBE_IMPLEMENTATION,
    SinkEstimate,
    choose_sink_count,
    early_key_mass,
    estimate_layer_sinks,
    load_layer_sinks,
    plant_attention_sink,
    save_layer_sinks,
    uniform_baseline_mass,
)

__all__ = [
    "IMPLEMENTATION",
    "DEFAULT_SINK_LOGIT",
    "SINKS_FILENAME",
    "causal_mask",
    "sliding_window_mask",
    "sink_token_mask",
    "document_mask",
    "key_padding_mask",
    "sink_window_mask",
    "document_starts",
    "SinkFlexMask",
    "apply_zero_value_sink",
    "sink_attention",
    "reference_attention",
    "register",
    "sinkflex_attention_forward",
    "sinkflex_mask",
    "apply",
    "remove",
    "sink_parameters",
    "load_sink_logits",
    "attention_settings",
    "save_attention_settings",
    "early_key_mass",
    "SinkEstimate",
    "estimate_layer_sinks",
    "save_layer_sinks",
    "load_layer_sinks",
]

register()
