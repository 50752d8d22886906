"""Generation with sink attention: batched rollouts whose rows have different lengths (padding inside a
turn) pick the tokens each row picks alone, and transformers' static cache is refused clearly."""

from __future__ import annotations

import pytest
import torch

from sinkflex_core import attention as A
from sinkflex_core.models import build_model, tiny_qwen2_config
from sinkflex_core.rollout import GenerationRequest, HFBackend

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB = 128
STOP = [1]


@pytest.fixture(scope="module")
def sink_model():
    """A tiny random Qwen2 on sink attention (2 sinks, an 24-key window shorter than the histories) with
    learned sink logits away from their initial value, so that sinks, window and zero-value sink all count."""
    cfg = tiny_qwen2_config(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = A.apply(build_model(cfg, seed=3), n_sink=2, window=24, learn_sinks=True)
    with torch.no_grad():
        for i, p in enumerate(A.sink_parameters(model)):
            p.copy_(torch.linspace(-2.0, 1.0, p.numel()) + 0.5 * i)
    return model


def _greedy_turns(backend: HFBackend, histories: dict[int, list[int]], turns: int, extra: dict[int, list[list[int]]]):
    """Greedy tokens of every row over ``turns`` turns; after each turn a row's history gets its tokens and
    then the environment's ``extra[key][turn]``."""
    histories = {k: list(h) for k, h in histories.items()}
    picked = {k: [] for k in histories}
    for turn in range(turns):
        reqs = [GenerationRequest(k, h, max_new_tokens=12, seed=k) for k, h in histories.items()]
        for k, res in zip(list(histories), backend.generate(reqs, temperature=0.0)):
            picked[k].append(res.token_ids)
            histories[k] += res.token_ids + extra[k][turn]
    return picked


@pytest.mark.parametrize("fast_path", [True, False])
def test_batched_sink_generation_picks_each_rows_own_tokens(sink_model, fast_path):
    g = torch.Generator().manual_seed(0)
    lengths = [31, 9, 22, 14]  # longer than the window: the window and the sinks both matter
    histories = {k: torch.randint(2, VOCAB, (n,), generator=g).tolist() for k, n in enumerate(lengths)}
    extra = {k: [torch.randint(2, VOCAB, (3 + 7 * k,), generator=g).tolist() for _ in range(3)]
             for k in histories}
    together = _greedy_turns(HFBackend(sink_model, stop_token_ids=STOP, fast_path=fast_path), histories, 3, extra)
    for k in histories:
        alone = _greedy_turns(HFBackend(sink_model, stop_token_ids=STOP, fast_path=fast_path),
                              {k: histories[k]}, 3, extra)
        assert together[k] == alone[k], k
    # the check is not vacuous: the rows did generate, and the model is on sink attention
    assert all(sum(len(t) for t in together[k]) > 3 for k in histories)
    assert sink_model.config._attn_implementation == A.IMPLEMENTATION


@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_a_static_cache_equals_the_dynamic_cache(sink_model, padded):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, VOCAB, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    sink_model.generation_config.pad_token_id = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with torch.no_grad():
        dynamic = sink_model.generate(ids, **kw)
        static = sink_model.generate(ids, cache_implementation="static", **kw)
        # the same tokens as a plain forward over each row picks greedily (no cache at all)
        row = dynamic[1:, 6 if padded else 0:]
        steps = [int(sink_model(input_ids=row[:, :t]).logits[0, -1].argmax()) for t in range(30 - (6 if padded else 0),
                                                                                                 row.shape[1])]
    assert torch.equal(static, dynamic)
    assert steps == row[0, -8:].tolist()
