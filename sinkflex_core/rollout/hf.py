"""Generation with a transformers causal LM: batched, keeping each episode's KV cache between turns
(:class:`HFBackend`). What makes it fast lives in :mod:`sinkflex_core.rollout.hf_fast`."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence

import torch

from .backend import GenerationRequest, GenerationResult, sample_tokens
from .hf_fast import compact_rows, grouped_sdpa, growing_cache, park_rows, unpark_rows
from .sink_decode import rolling_keep, sink_decode


class HFBackend:
    """Batched sampling with a transformers causal LM, keeping each episode's KV cache between turns.

    One ``DynamicCache`` holds a row per live episode. A turn prefills only the tokens that are new
    since the row's last forward (the previous turn's end token and the environment's delta), then
    decodes token by token. Rows are right-padded inside a turn, so the cache has padding columns in
    the middle of a row: a 2D attention mask hides them and explicit position ids keep each row's
    positions contiguous (0..n-1, as in a plain forward over the trajectory). Rows of finished episodes
    are dropped and all-padding columns squeezed out at the start of each turn.

    ``reuse_cache=False`` re-encodes each episode's whole history every turn (the baseline).
    ``fast_path`` (default): the cache grows in preallocated room rather than by concatenation, and
    with a model on transformers' ``"sdpa"`` attention, grouped-query attention runs without expanding
    the cache (:mod:`sinkflex_core.rollout.hf_fast`; the same attention, within float rounding), and with a
    model on sink attention (``"sinkflex"``), each decoded token is one masked pass over a cache that
    keeps, between turns, only each row's sinks and last ``window - 1`` keys
    (:mod:`sinkflex_core.rollout.sink_decode`; positions come from the tokens a row has seen). Decoding is
    memory-bound on the cache, so the fast path also keeps padding out of it: once a quarter of the
    rows of a turn have stopped, they are set aside until the turn ends (the others decode on without
    them), and each turn starts from a cache whose rows hold their real tokens first, as wide as the
    longest row. On the 64 rollouts of one GRPO step of the tiny SFT policy (two threads), before these
    two changes 37 % of the cache columns attended to held real tokens and the step's rollouts took
    71 s; after them and the inverse-CDF sampling of :func:`sample_tokens`, 36 s on the same tasks
    (other samples). ``fast_path=False`` uses transformers' stock ``DynamicCache`` and SDPA (the
    reference): ``python benchmarks/bench_rollout.py --policy runs/curve/sft_identity`` measured 277 s
    for it and 28 s for the fast path on such a step, 63 of the 64 trajectories identical (the 64th
    drew a token of probability 4e-7 where the two paths' log-probs, 3e-5 apart after 1,370 tokens,
    put the boundary on either side). Deterministic on CPU for a given batch and seeds."""

    def __init__(self, model, tokenizer=None, stop_token_ids: Sequence[int] | None = None,
                 pad_token_id: int | None = None, reuse_cache: bool = True, fast_path: bool = True):
        if stop_token_ids is None:
            if tokenizer is None or tokenizer.eos_token_id is None:
                raise ValueError("HFBackend needs stop_token_ids or a tokenizer with an eos_token")
            stop_token_ids = [tokenizer.eos_token_id]
        self.model = model
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        if pad_token_id is None:
            if tokenizer is not None and tokenizer.pad_token_id is not None:
                pad_token_id = tokenizer.pad_token_id
            else:  # any id will do: padding columns are masked
                pad_token_id = min(self.stop_token_ids, default=0)
        self.pad_token_id = int(pad_token_id)
        self.reuse_cache = reuse_cache
        self.fast_path = fast_path
        self.stats = {"prefill_tokens": 0, "generated_tokens": 0, "forward_calls": 0}
        self.release()

    def release(self) -> None:
        self._cache = None
        self._keys: list[Hashable] = []
        self._fed: list[list[int]] = []  # ids in the cache per row
        self._mask: torch.Tensor | None = None  # (B, C) 1 where the cache column holds a real token
        self._seen: torch.Tensor | None = None  # (B,) tokens fed per row: the next token's position

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, chunk: torch.Tensor, chunk_mask: torch.Tensor) -> torch.Tensor:
        """Feed (B, n) new columns; return the logits (B, V) at each row's last real new token."""
        if self._cache is None:
            if self.fast_path:
                self._cache = growing_cache(self.model.config)
            else:
                from transformers import DynamicCache

                self._cache = DynamicCache(config=self.model.config)
        past = self._mask
        # positions from the tokens each row has seen, not from its cache columns: a sink-attention
        # cache drops the keys no later query can see
        n_before = self._seen[:, None] if past is not None else torch.zeros_like(chunk[:, :1])
        positions = (n_before + chunk_mask.cumsum(dim=1) - 1).clamp(min=0)
        full_mask = chunk_mask if past is None else torch.cat([past, chunk_mask], dim=1)
        self._seen = n_before[:, 0] + chunk_mask.sum(dim=1)
        with self._attention():
            hidden = self.model.get_decoder()(input_ids=chunk, attention_mask=full_mask, position_ids=positions,
                                              past_key_values=self._cache, use_cache=True).last_hidden_state
        last = (chunk_mask * torch.arange(chunk.shape[1], device=chunk.device)).argmax(dim=1)
        h = hidden[torch.arange(chunk.shape[0], device=chunk.device), last]
        self._mask = full_mask
        self.stats["forward_calls"] += 1
        return self.model.get_output_embeddings()(h)

    def _attention(self):
        """The fast path's attention for this model while it runs (grouped SDPA, or sink attention's
        one-token decode), or the model's own."""
        if not self.fast_path:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(grouped_sdpa(self.model))
        stack.enter_context(sink_decode(self.model))
        return stack

    def _select_rows(self, keys: list[Hashable], prompts: list[list[int]]) -> bool:
        """Keep the cache rows of ``keys`` in that order; False if the cache cannot serve them."""
        if not self.reuse_cache or self._cache is None:
            return False
        index = {k: i for i, k in enumerate(self._keys)}
        if any(k not in index for k in keys):
            return False
        rows = [index[k] for k in keys]
        for r, p in zip(rows, prompts):
            fed = self._fed[r]
            if len(fed) >= len(p) or p[:len(fed)] != fed:
                return False
        idx = torch.tensor(rows, device=self.device)
        self._seen = self._seen[idx]
        if self.fast_path:
            self._mask = compact_rows(self._cache, self._mask, idx, rolling_keep(self.model))
        else:
            mask = self._mask[idx]
            keep = mask.any(dim=0).nonzero()[:, 0]
            for layer in self._cache.layers:
                layer.keys = layer.keys[idx][:, :, keep]
                layer.values = layer.values[idx][:, :, keep]
            self._mask = mask[:, keep]
        self._fed = [self._fed[r] for r in rows]
        self._keys = list(keys)
        return True

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[GenerationResult]:
        if not requests:
            return []
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.key!r} has an empty prompt")
            if r.max_new_tokens < 1:
                raise ValueError(f"request {r.key!r} asks for max_new_tokens={r.max_new_tokens} (< 1)")
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys):
            raise ValueError("two requests share a key")
        prompts = [list(r.prompt_ids) for r in requests]
        if not self._select_rows(keys, prompts):
            self.release()
            self._keys, self._fed = list(keys), [[] for _ in keys]
        dev = self.device
        B = len(requests)
        new = [p[len(f):] for p, f in zip(prompts, self._fed)]
        width = max(len(x) for x in new)
        chunk = torch.full((B, width), self.pad_token_id, dtype=torch.long, device=dev)
        chunk_mask = torch.zeros((B, width), dtype=torch.long, device=dev)
        for i, x in enumerate(new):
            chunk[i, :len(x)] = torch.tensor(x, dtype=torch.long)
            chunk_mask[i, :len(x)] = 1
        self.stats["prefill_tokens"] += sum(len(x) for x in new)
        for f, x in zip(self._fed, new):
            f.extend(x)
        logits = self._forward(chunk, chunk_mask)

        generators = [torch.Generator().manual_seed(int(r.seed)) for r in requests]
        out_ids: list[list[int]] = [[] for _ in requests]
        out_logp: list[list[float]] = [[] for _ in requests]
        stopped = [False] * B
        done = [False] * B
        rows = list(range(B))  # the request of each row the cache holds now
        parked: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []
        parked_seen: list[torch.Tensor] = []
        while True:
            tokens, logp = sample_tokens(logits.cpu(), temperature, top_p, [generators[i] for i in rows])
            for j, i in enumerate(rows):
                if done[i]:
                    continue
                t = int(tokens[j])
                out_ids[i].append(t)
                out_logp[i].append(float(logp[j]))
                if t in self.stop_token_ids:
                    done[i] = stopped[i] = True
                elif len(out_ids[i]) >= requests[i].max_new_tokens:
                    done[i] = True
            if all(done):
                break
            finished = [j for j, i in enumerate(rows) if done[i]]
            if self.fast_path and 4 * len(finished) >= len(rows):
                # A quarter of the rows have stopped: set them aside until the turn ends, so that the
                # others do not decode (and grow the cache) for them. A copy of the cache each time,
                # O(log B) times a turn.
                part, self._mask = park_rows(self._cache, self._mask, finished, rows)
                parked.append(part)
                gone = set(finished)
                parked_seen.append(self._seen[finished])
                self._seen = self._seen[[j for j in range(len(rows)) if j not in gone]]
                rows = [i for i in rows if not done[i]]
            # Feed the last sampled token of rows still going; finished rows get a hidden pad column.
            live = torch.tensor([0 if done[i] else 1 for i in rows], dtype=torch.long, device=dev)
            step = torch.tensor([self.pad_token_id if done[i] else out_ids[i][-1] for i in rows],
                                dtype=torch.long, device=dev)
            for i in rows:
                if not done[i]:
                    self._fed[i].append(out_ids[i][-1])
            logits = self._forward(step[:, None], live[:, None])
        if parked:
            order = torch.tensor([i for part in (rows, *(p[0] for p in parked)) for i in part])
            self._seen = torch.cat([self._seen, *parked_seen])[torch.argsort(order)]
            self._mask = unpark_rows(self._cache, self._mask, parked, rows)
        self.stats["generated_tokens"] += sum(len(x) for x in out_ids)
        return [GenerationResult(ids, lp, s) for ids, lp, s in zip(out_ids, out_logp, stopped)]

