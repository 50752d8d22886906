"""GRPO math: hand-computed cases, gradient checks, masks, padding and micro-batch invariance, and the
chunked log-probs against the naive full-logits path."""

from __future__ import annotations

import math

import pytest
import torch

from sinkflex_core.grpo import (
    AGG_MODES,
    GRPOLossConfig,
    aggregate_loss,
    behaviour_weights,
    causal_token_logprobs,
    group_advantages,
    grpo_loss,
    kl_penalty,
    loss_normalizers,
    naive_token_logprobs,
    policy_loss,
    reward_metrics,
    rows_with_signal,
    token_advantages,
    token_logprobs,
)

f64 = torch.float64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 2.0, 5.0])
    groups = torch.tensor([7, 7, 3, 7, 7, 3, 11])  # non-contiguous ids; group 3 all equal, 11 singleton
    adv = group_advantages(rewards, groups, eps=0.0)
    # group 7: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 1/sqrt(3)
    a = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, -a, a, 0.0, 0.0]))
    adv_eps = group_advantages(rewards, groups, eps=0.1)
    torch.testing.assert_close(adv_eps[0], torch.tensor(0.5 / (1 / math.sqrt(3) + 0.1)))
    dr = group_advantages(rewards, groups, norm_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, 0.0, -0.5, 0.5, 0.0, 0.0]))


def test_group_advantages_no_nan_for_degenerate_groups():
    # 0.1 three times: the float mean differs from 0.1 in the last bit; must still give exactly 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 3.0], dtype=torch.float32)
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1]), eps=0.0)
    assert torch.equal(adv, torch.zeros(4))
    ints = group_advantages(torch.tensor([1, 0, 1, 0]), torch.tensor([0, 0, 0, 0]))
    assert ints.dtype == torch.float32 and torch.isfinite(ints).all() and ints.sum().abs() < 1e-6


def test_group_of_eight_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(32, generator=g, dtype=f64)
    groups = torch.arange(4).repeat_interleave(8)
    adv = group_advantages(rewards, groups, eps=1e-6)
    for k in range(4):
        r = rewards[groups == k]
        torch.testing.assert_close(adv[groups == k], (r - r.mean()) / (r.std(unbiased=True) + 1e-6))


def test_token_advantages_broadcast_through_mask():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1]])
    out = token_advantages(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 2.0, 0.0], [-1.0, 0.0, -1.0, -1.0]]))


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.ones(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.ones(3), torch.zeros(3, dtype=torch.long), eps=-1)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), dual_clip=0.5)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(torch.zeros(2), torch.zeros(2), kind="k4")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), mode="sum")
    with pytest.raises(ValueError, match="labels outside"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(5, 4), torch.tensor([1, 5]))
    with pytest.raises(ValueError, match="weight must be"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(5, 3), torch.tensor([1, 2]))


def test_nan_settings_are_refused_not_turned_into_nan_losses():
    """Every range check must fail for NaN too: a NaN eps, clip or norm_length would give NaN
    advantages or a NaN loss, and a NaN dual clip would silently switch the dual clip off."""
    nan = float("nan")
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), eps=nan)
    for kw in (dict(clip_low=nan), dict(clip_high=nan)):
        with pytest.raises(ValueError, match="clip_low"):
            policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), **kw)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), -torch.ones(1), dual_clip=nan)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), mode="seq-mean-token-sum-norm", norm_length=nan)


# ----------------------------------------------------------------------------------- policy loss, KL


def test_policy_loss_hand_computed_clip_higher_and_dual_clip():
    ratios = torch.tensor([0.5, 0.9, 1.1, 1.5, 4.0], dtype=f64)
    logp = ratios.log().repeat(2, 1).requires_grad_()
    old = torch.zeros_like(logp)
    adv = torch.tensor([1.0, -1.0], dtype=f64)
    out = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    expected = torch.tensor([[-0.5, -0.9, -1.1, -1.28, -1.28],  # A>0: high side clipped at 1.28
                             [0.8, 0.9, 1.1, 1.5, 4.0]], dtype=f64)  # A<0: low side clipped at 0.8
    torch.testing.assert_close(out.loss, expected)
    assert out.clipped_high.tolist() == [[False, False, False, True, True], [False] * 5]
    assert out.clipped_low.tolist() == [[False] * 5, [True, False, False, False, False]]
    # d loss / d logp = -A * ratio where unclipped, 0 where clipped
    (g,) = torch.autograd.grad(out.loss.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[-0.5, -0.9, -1.1, 0, 0], [0, 0.9, 1.1, 1.5, 4.0]], dtype=f64))
    dual = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(dual.loss[1], torch.tensor([0.8, 0.9, 1.1, 1.5, 3.0], dtype=f64))
    torch.testing.assert_close(dual.loss[0], expected[0])  # positive advantages untouched
    assert dual.dual_clipped.tolist() == [[False] * 5, [False] * 4 + [True]]


def test_policy_loss_ratio_clamped():
    out = policy_loss(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), torch.tensor([1.0]), clip_high=1e9)
    assert torch.isfinite(out.loss).all()
    torch.testing.assert_close(out.ratio, torch.tensor([[math.exp(20.0)]]))


def test_kl_estimators_hand_computed_and_unbiased():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    x = math.log(0.5)  # ref - logp
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([-x]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * x * x]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 - x - 1]))
    # Exact expectation under p of k1 and k3 equals KL(p || q); k2 does not (it is biased).
    p = torch.tensor([0.6, 0.3, 0.1], dtype=f64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=f64)
    kl = (p * (p / q).log()).sum()
    for kind in ("k1", "k3"):
        torch.testing.assert_close((p * kl_penalty(p.log(), q.log(), kind, max_value=None)).sum(), kl)
    assert abs(float((p * kl_penalty(p.log(), q.log(), "k2")).sum() - kl)) > 1e-3
    assert (kl_penalty(torch.zeros(1), torch.tensor([30.0]), "k3") == 10.0).all()  # clamped like verl


# ------------------------------------------------------------------------------------- aggregation


def test_aggregation_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean"), torch.tensor(10 / 4))
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), torch.tensor((2 + 4) / 2))
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=4),
                               torch.tensor(10 / (2 * 4)))
    assert loss_normalizers(mask) == {"num_tokens": 4, "num_seqs": 2}
    loss[mask == 0] = float("nan")  # masked positions cannot leak, even as NaN
    assert torch.isfinite(aggregate_loss(loss, mask, "token-mean"))
    # a mini-batch without a policy token gives 0, with its own counts or with the counts passed in
    empty = torch.zeros_like(mask)
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert aggregate_loss(loss, empty, mode).item() == 0.0
        assert aggregate_loss(loss, empty, mode, **loss_normalizers(empty)).item() == 0.0


# ------------------------------------------------------------------------------------ gradient checks


def test_gradcheck_policy_kl_aggregation():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 5, generator=g, dtype=f64) * 2).requires_grad_()
    # ratios well away from the clip edges, where the loss is not differentiable
    old = logp.detach() + torch.tensor([-0.5, -0.05, 0.0, 0.05, 0.5], dtype=f64)
    adv = torch.randn(3, 5, generator=g, dtype=f64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1]])
    for dual in (None, 1.5):
        assert torch.autograd.gradcheck(
            lambda lp, d=dual: policy_loss(lp, old, adv, 0.2, 0.28, d).loss, (logp,))
    ref = logp.detach() + torch.randn(3, 5, generator=g, dtype=f64) * 0.3
    for kind in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda lp, k=kind: kl_penalty(lp, ref, k), (logp,))
    for mode in AGG_MODES:
        assert torch.autograd.gradcheck(lambda x, m=mode: aggregate_loss(x, mask, m, norm_length=7), (logp,))


@pytest.mark.parametrize("weight_grad,entropy_grad", [(True, True), (True, False), (False, False), (False, True)])
def test_gradcheck_token_logprobs(weight_grad, entropy_grad):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 5, 4, generator=g, dtype=f64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=f64, requires_grad=weight_grad)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[1, 2] = -100

    def fn(*inputs):
        lp, ent = token_logprobs(*inputs, labels, chunk_size=3, entropy_grad=entropy_grad) if weight_grad \
            else token_logprobs(inputs[0], w, labels, chunk_size=3, entropy_grad=entropy_grad)
        return (lp, ent) if entropy_grad else lp

    assert torch.autograd.gradcheck(fn, (h, w) if weight_grad else (h,))


# ------------------------------------------------------------------------- chunked vs naive, exactness


@pytest.mark.parametrize("weight_grad", [True, False])
def test_chunked_logprobs_exact_fp32(weight_grad):
    g = torch.Generator().manual_seed(3)
    B, L, H, V = 3, 170, 64, 5003
    h0 = torch.randn(B, L, H, generator=g) * 2
    w0 = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (B, L), generator=g)
    g_lp, g_ent = torch.randn(B, L, generator=g), torch.randn(B, L, generator=g)

    def run(fn, **kw):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_(weight_grad)
        lp, ent = fn(h, w, labels, **kw)
        ((lp * g_lp).sum() + (ent * g_ent).sum() * kw.get("entropy_grad", True)).backward()
        return lp, ent, h.grad, w.grad

    ref = run(naive_token_logprobs)
    for entropy_grad in (True, False):
        got = run(token_logprobs, chunk_size=128, entropy_grad=entropy_grad)
        if not entropy_grad:  # compare with a naive run whose entropy has no gradient either
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_(weight_grad)
            lp, _ = naive_token_logprobs(h, w, labels)
            (lp * g_lp).sum().backward()
            ref = (ref[0], ref[1], h.grad, w.grad)
        assert got[1].requires_grad == entropy_grad
        for name, a, b in zip(("logp", "entropy", "grad hidden", "grad weight"), got, ref):
            if b is None:
                assert a is None, name
                continue
            assert rel_err(a, b) < 1e-5, (name, entropy_grad, rel_err(a, b))


def test_grad_in_forward_matches_recompute():
    g = torch.Generator().manual_seed(4)
    h0, w = torch.randn(40, 16, generator=g), torch.randn(300, 16, generator=g)
    labels = torch.randint(0, 300, (40,), generator=g)
    grads = []
    for gif in (True, False):
        h = h0.clone().requires_grad_()
        lp, _ = token_logprobs(h, w, labels, chunk_size=7, grad_in_forward=gif)
        (lp * torch.arange(40.0)).sum().backward()
        grads.append(h.grad)
    assert rel_err(grads[0], grads[1]) < 1e-6
    with pytest.raises(ValueError, match="frozen"):
        token_logprobs(h0, w.requires_grad_(), labels, grad_in_forward=True)


def test_bfloat16_close_to_fp32():
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(64, 32, generator=g), torch.randn(500, 32, generator=g) * 0.2
    labels = torch.randint(0, 500, (64,), generator=g)
    lp32, _ = naive_token_logprobs(h, w, labels)
    hb = h.bfloat16().requires_grad_()
    wb = w.bfloat16().requires_grad_()
    lp16, ent = token_logprobs(hb, wb, labels, chunk_size=16)
    assert lp16.dtype == torch.float32 and rel_err(lp16, lp32) < 2e-2
    lp16.sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16


def test_causal_shift_by_one():
    g = torch.Generator().manual_seed(6)
    h = torch.randn(2, 6, 8, generator=g, dtype=f64)
    w = torch.randn(13, 8, generator=g, dtype=f64)
    ids = torch.randint(0, 13, (2, 6), generator=g)
    lp, ent = causal_token_logprobs(h, w, ids, chunk_size=4)
    logits = h @ w.T
    full = torch.log_softmax(logits, -1)
    assert lp.shape == ids.shape and (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    for b in range(2):
        for t in range(1, 6):
            torch.testing.assert_close(lp[b, t], full[b, t - 1, ids[b, t]])
            torch.testing.assert_close(ent[b, t], -(full[b, t - 1].exp() * full[b, t - 1]).sum())


# --------------------------------------------------- masks, padding, micro-batches on a real tiny model


class TinyPolicy(torch.nn.Module):
    """Embedding -> tanh layer -> output layer; enough for the loss to see real hidden states."""

    def __init__(self, vocab=37, hidden=12, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def hidden(self, ids):
        x = self.emb(ids)
        # causal running mean so that hidden t depends on tokens <= t only (padding on the right is inert)
        x = x.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]
        return torch.tanh(self.mix(x))

    def logprobs(self, ids, chunk=5):
        return causal_token_logprobs(self.hidden(ids), self.head.weight, ids, chunk_size=chunk)


def make_batch(B=6, seed=0, vocab=37):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 11, 8, 3, 14, 9][:B]
    L = max(lengths)
    ids = torch.randint(0, vocab, (B, L), generator=g)
    loss_mask = torch.zeros(B, L, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
        loss_mask[b, 2:n] = 1  # prompt of 2 tokens, then policy tokens
        if n > 6:
            loss_mask[b, 4:6] = 0  # an environment reply inside the trajectory
    # old and reference log-probs near the policy's own, so that some tokens are clipped and most not
    with torch.no_grad():
        lp, _ = TinyPolicy().logprobs(ids)
    old = (lp + 0.15 * torch.randn(B, L, generator=g)) * loss_mask
    ref = (lp + 0.1 * torch.randn(B, L, generator=g)) * loss_mask
    rewards = torch.rand(B, generator=g)
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1][:B]))
    return ids, loss_mask, old, ref, adv, lengths


def loss_and_grads(model, ids, loss_mask, old, ref, adv, mode, counts=None, norm_length=16):
    lp, ent = model.logprobs(ids)
    cfg = GRPOLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.04, agg_mode=mode)
    loss, metrics = grpo_loss(lp, old, adv, loss_mask, ref_logp=ref, entropy=ent, config=cfg,
                              norm_length=norm_length, **(counts or {}))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("mode", AGG_MODES)
def test_masked_tokens_change_neither_loss_nor_grads(mode):
    model = TinyPolicy()
    ids, loss_mask, old, ref, adv, _ = make_batch()
    base_loss, base_grads, _ = loss_and_grads(model, ids, loss_mask, old, ref, adv, mode)
    # Change everything the masked positions could carry: their token ids (so the logits at those
    # positions change), and their old / reference log-probs (extreme values).
    ids2, old2, ref2 = ids.clone(), old.clone(), ref.clone()
    off = (loss_mask == 0)
    off[:, :2] = False  # keep the prompt ids: later hidden states (and so real tokens) depend on them
    # only positions after which no policy token depends on the ids: the trailing padding
    last_policy = torch.tensor([int(torch.nonzero(r).max()) for r in loss_mask])
    trailing = torch.arange(ids.shape[1])[None, :] > last_policy[:, None]
    ids2[trailing] = (ids2[trailing] + 7) % 37
    old2[off] = -1e4
    ref2[off] = 50.0
    loss2, grads2, _ = loss_and_grads(model, ids2, loss_mask, old2, ref2, adv, mode)
    assert torch.equal(loss2, base_loss)
    for a, b in zip(grads2, base_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    # and the test can fail: flipping one policy token's old log-prob does change the loss
    old3 = old.clone()
    old3[loss_mask == 1] -= 0.3
    assert not torch.equal(loss_and_grads(model, ids, loss_mask, old3, ref, adv, mode)[0], base_loss)


def test_masked_logits_get_no_gradient():
    """Hidden states whose next token is masked receive exactly zero gradient from the loss."""
    ids, loss_mask, _, _, adv, _ = make_batch()
    g = torch.Generator().manual_seed(9)
    h = torch.randn(*ids.shape, 12, generator=g, requires_grad=True)
    w = torch.randn(37, 12, generator=g, requires_grad=True)
    lp, ent = causal_token_logprobs(h, w, ids, chunk_size=4)
    old = lp.detach()  # ratio 1: no token is clipped, so every policy token has a gradient
    loss, _ = grpo_loss(lp, old, adv, loss_mask, ref_logp=old + 0.1, entropy=ent)
    loss.backward()
    # hidden t predicts token t + 1
    feeds_masked = torch.ones_like(loss_mask, dtype=torch.bool)
    feeds_masked[:, :-1] = loss_mask[:, 1:] == 0
    assert (h.grad[feeds_masked] == 0).all()
    assert (h.grad[~feeds_masked].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_padding_invariance(mode):
    model = TinyPolicy()
    ids, loss_mask, old, ref, adv, _ = make_batch()
    base_loss, base_grads, _ = loss_and_grads(model, ids, loss_mask, old, ref, adv, mode)
    pad = 9
    padded = [torch.nn.functional.pad(t, (0, pad)) for t in (ids, loss_mask, old, ref)]
    loss2, grads2, _ = loss_and_grads(model, *padded, adv, mode)
    torch.testing.assert_close(loss2, base_loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads2, base_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_invariance(mode):
    """Summing micro-batch losses normalised by the mini-batch's global counts gives the mini-batch's
    gradient exactly, whatever the split and however each micro-batch is padded."""
    model = TinyPolicy()
    ids, loss_mask, old, ref, adv, lengths = make_batch()
    full_loss, full_grads, _ = loss_and_grads(model, ids, loss_mask, old, ref, adv, mode)
    counts = loss_normalizers(loss_mask)
    for split in ([2, 1, 3], [1] * 6, [3, 3], [5, 1]):
        acc_loss, acc_grads, naive_grads = 0.0, None, None
        start = 0
        for size in split:
            rows = slice(start, start + size)
            width = max(lengths[rows])  # each micro-batch trimmed to its own padded width
            part = [t[rows, :width] for t in (ids, loss_mask, old, ref)]
            loss, grads, _ = loss_and_grads(model, *part, adv[rows], mode, counts=counts)
            _, local, _ = loss_and_grads(model, *part, adv[rows], mode)  # per-micro-batch counts
            acc_loss += loss
            acc_grads = grads if acc_grads is None else [a + b for a, b in zip(acc_grads, grads)]
            naive_grads = [g / len(split) for g in local] if naive_grads is None else \
                [a + g / len(split) for a, g in zip(naive_grads, local)]
            start += size
        torch.testing.assert_close(acc_loss, full_loss, rtol=1e-6, atol=1e-7)
        for a, b in zip(acc_grads, full_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        # local normalisation + averaging is NOT invariant for this data (so the check above can fail);
        # for the per-sequence modes it is when all micro-batches have the same number of rows
        if mode == "token-mean" or len(set(split)) > 1:
            assert max(rel_err(a, b) for a, b in zip(naive_grads, full_grads)) > 1e-3


def test_metrics():
    logp = torch.log(torch.tensor([[0.5, 0.9, 1.1, 1.5]]))
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    ent = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    loss, m = grpo_loss(logp, old, torch.tensor([1.0]), mask, entropy=ent,
                        config=GRPOLossConfig(clip_low=0.2, clip_high=0.05))
    # token 3 (ratio 1.1 > 1.05, A > 0) is clipped; token 1 (0.5 < 0.8 but A > 0) is not: 1 of 3
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["clip_frac_high"] == pytest.approx(1 / 3)
    assert m["clip_frac_low"] == 0 and m["entropy"] == pytest.approx(2.0)
    lr = logp[0, :3]
    assert m["approx_kl"] == pytest.approx(float((lr.exp() - 1 - lr).mean()), rel=1e-5)
    assert m["approx_kl_k1"] == pytest.approx(float(-lr.mean()), rel=1e-5)
    assert m["loss"] == pytest.approx(-(0.5 + 0.9 + 1.05) / 3, rel=1e-6)
    # ratios over the policy tokens only (the masked 1.5 is not the maximum)
    assert m["ratio_mean"] == pytest.approx(2.5 / 3, rel=1e-6) and m["ratio_max"] == pytest.approx(1.1, rel=1e-6)
    assert m["dual_clip_frac"] == 0 and m["num_tokens"] == 3
    # A < 0 with a dual clip of 1.2 over all four tokens: 0.5 is clipped up to 0.8 (low side), 1.5 is
    # bounded by the dual clip; 1.1 > 1.05 leaves the clipped branch inactive for A < 0
    _, neg = grpo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 4),
                       config=GRPOLossConfig(clip_low=0.2, clip_high=0.05, dual_clip=1.2))
    assert neg["dual_clip_frac"] == 0.25 and neg["clip_frac_low"] == 0.25 and neg["clip_frac_high"] == 0
    assert neg["loss"] == pytest.approx((0.8 + 0.9 + 1.1 + 1.2) / 4, rel=1e-6)
    rm = reward_metrics(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert rm["reward_mean"] == 0.75 and rm["frac_groups_no_signal"] == 0.5 and rm["num_groups"] == 2
    # unbiased std: squared deviations 0.0625 * 3 + 0.5625 over 3 = 0.25
    assert rm["reward_std"] == pytest.approx(0.5) and (rm["reward_min"], rm["reward_max"]) == (0.0, 1.0)
    rm3 = reward_metrics(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), torch.tensor([4, 4, 2, 2, 9, 9]))
    assert rm3["frac_groups_no_signal"] == pytest.approx(2 / 3) and rm3["num_groups"] == 3


def test_grpo_loss_is_the_policy_loss_plus_kl_minus_the_entropy_bonus():
    """Each term by hand: ratio 1 everywhere (logp = old), so the policy term is -A averaged over the
    policy tokens; k3 with x = ref - logp; the entropy bonus subtracted, not added."""
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.2, 0.4], [0.1, 0.6, 0.3, 0.9]], dtype=f64))
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    x = [[0.2, -0.1, 0.3, 7.0], [9.0, 0.5, -0.4, 0.1]]  # the masked 7 and 9 cannot enter
    ref = logp + torch.tensor(x, dtype=f64)
    ent = torch.tensor([[1.0, 2.0, 3.0, 50.0], [60.0, 0.5, 1.5, 2.0]], dtype=f64)
    adv = torch.tensor([1.5, -0.5], dtype=f64)
    cfg = GRPOLossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, m = grpo_loss(logp, logp.detach(), adv, mask, ref_logp=ref, entropy=ent, config=cfg)
    kept = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 3)]
    pg = sum(-float(adv[b]) for b, _ in kept) / 6
    kl = sum(math.exp(x[b][t]) - x[b][t] - 1 for b, t in kept) / 6
    entropy = sum(float(ent[b, t]) for b, t in kept) / 6
    assert m["pg_loss"] == pytest.approx(pg, rel=1e-9)
    assert m["kl_ref"] == pytest.approx(kl, rel=1e-9)
    assert m["entropy"] == pytest.approx(entropy, rel=1e-9)
    assert float(loss) == pytest.approx(pg + 0.1 * kl - 0.01 * entropy, rel=1e-9)
    # no reference policy: no KL term, whatever kl_coef
    alone, m_alone = grpo_loss(logp, logp.detach(), adv, mask, entropy=ent, config=cfg)
    assert float(alone) == pytest.approx(pg - 0.01 * entropy, rel=1e-9) and "kl_ref" not in m_alone


def test_rows_with_signal_are_those_of_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 9, 2, 2])  # any ids, in any order
    assert rows_with_signal(rewards, groups).tolist() == [True, True, False, False, True, True, True, False, False]
    # Here every row of those groups has a nonzero advantage, and every other row advantage 0.
    assert torch.equal(rows_with_signal(rewards, groups), group_advantages(rewards, groups) != 0)


def test_group_statistics_refuse_rewards_they_cannot_pair_with_groups():
    """rows_with_signal and reward_metrics refuse what group_advantages refuses: a reward without its
    group id would be paired with another row's, and a NaN reward makes its group look uniform (its rows
    would silently leave the update)."""
    for fn in (rows_with_signal, reward_metrics):
        with pytest.raises(ValueError, match="must both be"):
            fn(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 0]))
        with pytest.raises(ValueError, match="NaN"):
            fn(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="at least one reward"):
        reward_metrics(torch.tensor([]), torch.tensor([], dtype=torch.long))


def test_behaviour_weights_and_truncation_by_hand():
    """pi_old / mu = 0.5 / 0.25, 0.2 / 0.4, 0.9 / 0.1 = 2, 0.5, 9; capped at 3: 2, 0.5, 3."""
    old = torch.tensor([[0.5, 0.2, 0.9]], dtype=f64).log()
    mu = torch.tensor([[0.25, 0.4, 0.1]], dtype=f64).log()
    w, cut = behaviour_weights(old, mu, cap=3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 3.0]], dtype=f64))
    assert cut.tolist() == [[False, False, True]]
    w0, cut0 = behaviour_weights(old, mu)  # cap 0: not truncated
    assert torch.allclose(w0, torch.tensor([[2.0, 0.5, 9.0]], dtype=f64)) and not cut0.any()
    with pytest.raises(ValueError, match="cap must be >= 0"):
        behaviour_weights(old, mu, cap=-1.0)
    with pytest.raises(ValueError, match="shapes must match"):
        behaviour_weights(old, mu[:, :2])


def test_grpo_loss_weights_each_token_by_the_truncated_behaviour_ratio():
    """With logp = old_logp (PPO ratio 1) and A = 1 the token-mean loss is -mean(w) over the mask, and
    the gradient of token t is -w_t / n: the weight scales each token's policy gradient."""
    old = torch.tensor([[0.5, 0.2, 0.9]], dtype=f64).log()
    mu = torch.tensor([[0.25, 0.4, 0.1]], dtype=f64).log()
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=f64)  # the first token is the prompt's
    logp = old.clone().requires_grad_(True)
    cfg = GRPOLossConfig(kl_coef=0.0, tis_cap=3.0)
    loss, m = grpo_loss(logp, old, torch.tensor([1.0], dtype=f64), mask, config=cfg, behaviour_logp=mu)
    assert loss.item() == pytest.approx(-(0.5 + 3.0) / 2)
    assert m["tis_clip_frac"] == pytest.approx(0.5) and m["tis_weight_mean"] == pytest.approx(1.75)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.25, -1.5]], dtype=f64))
    plain, m_plain = grpo_loss(old.clone(), old, torch.tensor([1.0], dtype=f64), mask, config=cfg)
    assert plain.item() == pytest.approx(-1.0) and "tis_clip_frac" not in m_plain
