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


@pytest.fixture(scope="module")
def layered_model():
    """The same kind of model with a different sink count per layer (1 and 3) and a 20-key window."""
    cfg = tiny_qwen2_config(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = A.apply(build_model(cfg, seed=5), window=20, learn_sinks=True, layer_sinks=[1, 3])
    with torch.no_grad():
        for i, p in enumerate(A.sink_parameters(model)):
            p.copy_(torch.linspace(-1.5, 1.5, p.numel()) - 0.5 * i)
    return model.eval()


def _sampled_turns(backend: HFBackend, histories: dict[int, list[int]], extra: dict[int, list[list[int]]]):
    """Sample (temperature 1) every row over len(extra[k]) turns; returns the final histories and, per
    row, (position, token, sampler log-prob) of every generated token."""
    histories = {k: list(h) for k, h in histories.items()}
    sampled = {k: [] for k in histories}
    for turn in range(len(next(iter(extra.values())))):
        reqs = [GenerationRequest(k, h, max_new_tokens=10, seed=100 * turn + k) for k, h in histories.items()]
        for k, res in zip(list(histories), backend.generate(reqs, temperature=1.0)):
            start = len(histories[k])
            sampled[k] += [(start + j, t, lp) for j, (t, lp) in enumerate(zip(res.token_ids, res.logprobs))]
            histories[k] += res.token_ids + extra[k][turn]
    return histories, sampled


def test_sampler_logprobs_equal_the_trainers_sink_attention_forward(layered_model):
    """The rollout's log-prob of every sampled token equals the trainer's full-sequence forward with the
    same sink attention (per-layer sinks, window, learned sinks), for rows of different lengths in one
    batch over several turns: on the stock path and on the fast path, whose cache between turns keeps
    only each row's sinks and last window - 1 keys (moved to the front of the row), so the mask must
    count real tokens, not cache columns."""
    from sinkflex_core.rollout.sink_decode import rolling_keep
    from sinkflex_core.train import TokenLogprobs

    g = torch.Generator().manual_seed(4)
    lengths = [45, 7, 26, 13, 33]
    histories = {k: torch.randint(20, VOCAB, (n,), generator=g).tolist() for k, n in enumerate(lengths)}
    extra = {k: [torch.randint(20, VOCAB, (2 + 5 * k,), generator=g).tolist() for _ in range(4)] for k in histories}
    stops = list(range(2, 20))  # ~15 % of the vocabulary ends a turn: rows stop at different times
    runs = {}
    for fast in (True, False):
        backend = HFBackend(layered_model, stop_token_ids=stops, fast_path=fast)
        runs[fast] = _sampled_turns(backend, histories, extra)
        if fast:  # the cache did drop keys: its rows are shorter than the histories it serves
            assert rolling_keep(layered_model) == (3, 19)
            assert backend._select_rows(list(histories), [runs[fast][0][k] for k in histories])
            assert backend._mask.shape[1] <= 3 + 19 < min(len(h) for h in runs[fast][0].values())
    assert runs[True] == runs[False] or all(  # same samples (log-probs within rounding)
        [(p, t) for p, t, _ in runs[True][1][k]] == [(p, t) for p, t, _ in runs[False][1][k]] for k in histories)
    final, _ = runs[True]
    width = max(len(h) for h in final.values())
    ids = torch.zeros(len(final), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, h in enumerate(final.values()):
        ids[i, :len(h)], mask[i, :len(h)] = torch.tensor(h), 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        trainer_logp, _ = TokenLogprobs(layered_model)(ids, mask, positions)
    lengths_seen = set()
    for fast in (True, False):
        for i, k in enumerate(final):
            got = torch.tensor([lp for _, _, lp in runs[fast][1][k]])
            want = trainer_logp[i, [p for p, _, _ in runs[fast][1][k]]]
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
            lengths_seen.add(len(got))
    assert len(lengths_seen) > 2 and width > 3 * 20  # rows differ, and histories run far past the window


def test_per_layer_sink_counts_change_the_attention(layered_model):
    """The check above is not vacuous: with one sink count in every layer the same weights give other
    log-probs on sequences longer than the window."""
    import copy

    uniform = A.apply(copy.deepcopy(layered_model), n_sink=3, window=20, learn_sinks=True)
    ids = torch.randint(20, VOCAB, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = layered_model(input_ids=ids).logits, uniform(input_ids=ids).logits
    assert [m.sinkflex_n_sink for m in A._attention_modules(layered_model)] == [1, 3]
    assert (a - b).abs().max() > 1e-3
