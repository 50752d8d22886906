"""Memory tricks for long training steps.

``tile_mlp(model, slice_tokens)`` runs every decoder layer's MLP over slices of the sequence, each
slice checkpointed. A token-wise MLP gives the same numbers whether it sees the whole sequence or a
slice of it, so the result is exact; what changes is memory. A Qwen2.5-7B MLP widens each token from
3,584 to 18,944 features: at 131,072 tokens its gate, up and product activations are ~4.6 GiB each
in bf16, and under layer-level gradient checkpointing they are rebuilt whole during backward. Tiled,
only one slice's ``(slice_tokens, FFN)`` intermediates exist at a time, forward or backward.

The MLP modules keep their parameters and state-dict keys (only their ``forward`` is wrapped), so
checkpoints, LoRA adapters and optimizers see the same model; ``untile_mlp`` restores the plain
forward.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_PLAIN_FORWARD = "_sinkflex_plain_forward"
_SLICE_ATTR = "_sinkflex_slice_tokens"


def decoder_mlps(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The ``(name, module)`` of each decoder layer's MLP: the ``mlp`` child of every module whose
    class name ends in ``DecoderLayer`` (Qwen2, Qwen3, Llama, Mistral, Phi-3 ... in transformers),
    through any wrapper such as a peft model."""
    for name, module in model.named_modules():
        if type(module).__name__.endswith("DecoderLayer") and isinstance(getattr(module, "mlp", None), nn.Module):
            yield (f"{name}.mlp" if name else "mlp"), module.mlp


def _tiled_forward(self: nn.Module, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``hidden`` (..., L, H) -> (..., L, H): the plain MLP applied to slices of ``slice_tokens``
    positions along dim -2, each slice checkpointed when gradients are recorded."""
    plain = getattr(self, _PLAIN_FORWARD)
    size = getattr(self, _SLICE_ATTR)
    if hidden.dim() < 2 or hidden.shape[-2] <= size or args or kwargs:
        # Short inputs (and unusual call signatures) gain nothing from slicing.
        return plain(hidden, *args, **kwargs)
    needs_graph = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in self.parameters())
    )
    outputs = []
    for piece in hidden.split(size, dim=-2):
        if needs_graph:
            # Non-reentrant checkpointing nests inside the layer-level checkpoint of HF models and
            # keeps only the slice's input; its (slice, FFN) intermediates are rebuilt in backward.
            outputs.append(checkpoint(plain, piece, use_reentrant=False))
        else:
            outputs.append(plain(piece))
    return torch.cat(outputs, dim=-2)


def tile_mlp(model: nn.Module, slice_tokens: int = 8192) -> nn.Module:
    """Make every decoder MLP of ``model`` run over sequence slices of ``slice_tokens`` positions
    (checkpointed), so that the ``(L, FFN)`` intermediate never exists whole. Exact: the outputs
    and gradients equal the plain MLP's (up to the order of float additions in the weight gradients).

    Calling it again changes the slice size. Returns ``model`` (changed in place).
    Raises ``ValueError`` if ``slice_tokens`` is not a positive integer or the model has no decoder
    layer with an ``mlp`` (then it is not a transformers decoder this function knows)."""
    if isinstance(slice_tokens, bool) or not isinstance(slice_tokens, int) or slice_tokens < 1:
        raise ValueError(f"slice_tokens must be a positive integer, got {slice_tokens!r}")
    mlps = list(decoder_mlps(model))
    if not mlps:
        raise ValueError(
            f"tile_mlp: no decoder layer with an `mlp` found in {type(model).__name__}; it expects a "
            "transformers decoder (Qwen2/Llama-style layers named *DecoderLayer with an .mlp)")
    for _, mlp in mlps:
        if not hasattr(mlp, _PLAIN_FORWARD):
            setattr(mlp, _PLAIN_FORWARD, mlp.forward)
            mlp.forward = types.MethodType(_tiled_forward, mlp)
        setattr(mlp, _SLICE_ATTR, slice_tokens)
    return model


def untile_mlp(model: nn.Module) -> nn.Module:
    """Undo :func:`tile_mlp`: every decoder MLP runs whole again. Returns ``model``."""
    for _, mlp in decoder_mlps(model):
        if hasattr(mlp, _PLAIN_FORWARD):
            # The wrapped bound method lives in the instance dict; removing it uncovers the class's.
            del mlp.forward
            delattr(mlp, _PLAIN_FORWARD)
            delattr(mlp, _SLICE_ATTR)
    return model


def is_tiled(model: nn.Module) -> bool:
    """Whether :func:`tile_mlp` is active on ``model``'s decoder MLPs."""
    return any(hasattr(mlp, _PLAIN_FORWARD) for _, mlp in decoder_mlps(model))
