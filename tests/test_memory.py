"""tile_mlp: exact against the plain MLP (values and gradients), the (L, FFN) intermediate never
whole (forward and backward recompute), works under gradient checkpointing, with LoRA, for Qwen2
and Llama models, and undoable."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from sinkflex_core.memory import decoder_mlps, is_tiled, tile_mlp, untile_mlp

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _model(kind: str, dtype=torch.float64):
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    return model.to(dtype)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_is_exact(kind, checkpointing):
    plain = _model(kind)
    tiled = copy.deepcopy(plain)
    tile_mlp(tiled, slice_tokens=7)  # 37 tokens: 5 full slices and a short one
    for m in (plain, tiled):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(1))
    logits_p, grads_p = _loss_and_grads(plain, ids)
    logits_t, grads_t = _loss_and_grads(tiled, ids)
    torch.testing.assert_close(logits_t, logits_p, rtol=1e-12, atol=1e-12)
    assert grads_p.keys() == grads_t.keys() and len(grads_p) > 0
    for name in grads_p:
        torch.testing.assert_close(grads_t[name], grads_p[name], rtol=1e-10, atol=1e-12, msg=name)


def test_intermediate_never_whole_forward_or_backward():
    model = _model("qwen2", torch.float32)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tile_mlp(model, slice_tokens=16)
    seen = {"forward": [], "backward": []}
    phase = {"now": "forward"}

    def record(module, args, output):  # output: the (..., slice, FFN) intermediate
        seen[phase["now"]].append(output.shape[-2])

    hooks = [mlp.up_proj.register_forward_hook(record) for _, mlp in decoder_mlps(model)]
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 100))
    loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    phase["now"] = "backward"
    loss.backward()
    for h in hooks:
        h.remove()
    # 100 tokens in slices of 16: 7 slices per layer, none longer than 16, in both passes
    assert seen["forward"] and seen["backward"], "the MLP was not rebuilt in backward"
    assert max(seen["forward"]) <= 16 and max(seen["backward"]) <= 16
    assert sum(seen["forward"]) == 100 * SHAPE["num_hidden_layers"]

    untile_mlp(model)
    seen["forward"].clear()
    phase["now"] = "forward"
    hooks = [mlp.up_proj.register_forward_hook(record) for _, mlp in decoder_mlps(model)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert max(seen["forward"]) == 100  # plain again: the whole sequence at once


def test_tiled_mlp_with_lora_and_no_grad():
    from peft import LoraConfig, get_peft_model

    base = _model("qwen2")
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 50), generator=torch.Generator().manual_seed(2))
    results = []
    for tiled in (False, True):
        torch.manual_seed(3)
        lora_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj",
                                                                                          "up_proj"]))
        # Non-zero B so that every adapter gets a gradient
        for n, p in lora_model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
        if tiled:
            tile_mlp(lora_model, slice_tokens=8)
            assert is_tiled(lora_model)
        results.append(_loss_and_grads(lora_model, ids))
        with torch.no_grad():
            results.append((lora_model(input_ids=ids).logits, {}))
    (lp, gp), (ip, _), (lt, gt), (it, _) = results
    torch.testing.assert_close(lt, lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(it, ip, rtol=1e-12, atol=1e-12)
    assert any("lora_B" in n for n in gp) and any("up_proj.lora" in n for n in gp)
    for name in gp:
        torch.testing.assert_close(gt[name], gp[name], rtol=1e-10, atol=1e-12, msg=name)


def test_state_dict_unchanged_and_retile_and_untile():
    model = _model("llama", torch.float32)
    keys = list(model.state_dict())
    tile_mlp(model, slice_tokens=8)
    assert list(model.state_dict()) == keys
    tile_mlp(model, slice_tokens=4)  # calling again changes the slice size, does not wrap twice
    mlps = [m for _, m in decoder_mlps(model)]
    assert len(mlps) == SHAPE["num_hidden_layers"]
    assert all(m._sinkflex_slice_tokens == 4 for m in mlps)
    x = torch.randn(1, 9, SHAPE["hidden_size"])
    with torch.no_grad():
        tiled_out = mlps[0](x)
    untile_mlp(model)
    assert not is_tiled(model)
    assert "forward" not in vars(mlps[0])
    with torch.no_grad():
        torch.testing.assert_close(mlps[0](x), tiled_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "8"])
def test_bad_slice_size(bad):
    with pytest.raises(ValueError, match="slice_tokens"):
        tile_mlp(_model("qwen2", torch.float32), slice_tokens=bad)


def test_not_a_decoder():
    with pytest.raises(ValueError, match="no decoder layer"):
        tile_mlp(torch.nn.Sequential(torch.nn.Linear(4, 4)), slice_tokens=8)
