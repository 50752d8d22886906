"""The GRPO loop end to end with a tiny random Qwen2 policy on the retail environment: metrics and
checkpoints, exact resume after SIGKILL, micro-batch invariance, the reference policy, the
LoRA / sink-attention / checkpointing / chunked-log-prob options, and torchrun with FSDP2 on gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from interrupted_trainer import run_script

from sinkflex_core import train
from sinkflex_core.train import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]

# A random 2-layer policy has no chance of solving a task, so rewards (and advantages) are 0; the
# entropy bonus and the KL term still give every step a nonzero loss and gradient to compare.
TINY = dict(hidden_size=64, num_layers=2, tasks_per_step=2, group_size=2, num_minibatches=2, micro_batch_size=2,
            ppo_epochs=2, max_total_tokens=320, max_new_tokens_per_turn=12, max_turns=3, system_prompt="x",
            include_tools=False, eval_tasks=2, eval_samples=2, kl_coef=0.04, entropy_coef=0.01, lr=1e-3,
            threads=1, progress=False, tensorboard=False, save_every=1, eval_every=2)
COMPARED = ["reward_mean", "loss", "pg_loss", "kl", "entropy", "ratio_mean", "ratio_max", "grad_norm",
            "tokens_policy", "eval_reward"]


def _cfg(tokenizer_dir: str, out: Path, **kw) -> TrainConfig:
    return TrainConfig.from_dict({**TINY, "tokenizer": tokenizer_dir, "out_dir": str(out), **kw})


def _argv(cfg: TrainConfig) -> list[str]:
    default = train.resolve_config("tiny-cpu").to_dict()  # what the command line starts from
    return [f"--set={k}={train.cli_value(v)}".replace("'", "") for k, v in cfg.to_dict().items()
            if v != default[k]]


def _metrics(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "metrics.csv")


def test_the_command_line_without_its_bar_prints_a_line_a_step_and_says_when_nothing_is_left(
        tokenizer_dir, tmp_path, capsys):
    argv = _argv(_cfg(tokenizer_dir, tmp_path / "run", steps=2))
    assert train.main(argv) == 0
    out, err = capsys.readouterr()
    assert "model=tiny is a randomly initialised policy" in err
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(",")[0] for line in lines] == ["step 0/2", "step 1/2", "step 2/2"], out
    assert "reward" in lines[1] and lines[1].endswith(" s") and "eval" in lines[2]
    assert "done: step 2/2" in out
    assert train.main(argv) == 0  # the same run again: resumed, finished
    out, _ = capsys.readouterr()
    assert "nothing to do" in out and "step 2/2" in out and not any(line.startswith("step ") for line in out.splitlines())


def test_two_steps_log_metrics_checkpoint_and_change_the_policy(tokenizer_dir, tmp_path):
    cfg = _cfg(tokenizer_dir, tmp_path / "run", steps=2)
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    rows = trainer.run()
    df = _metrics(tmp_path / "run")
    assert list(df["step"]) == [0, 1, 2] and len(rows) == 3
    assert list(df.columns) == train.METRIC_COLUMNS
    assert df["eval_reward"].notna().tolist() == [True, False, True]  # before training, at eval_every, at the end
    assert (df["trajectories"].iloc[1:] == 4).all() and (df["tokens_policy"].iloc[1:] > 0).all()
    assert df["loss"].iloc[1:].abs().gt(0).all() and df["grad_norm"].iloc[1:].gt(0).all()
    assert (tmp_path / "run" / "config.json").is_file() and (tmp_path / "run" / "run_info.json").is_file()
    saved_cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert train.TrainConfig.from_dict(saved_cfg).to_dict() == cfg.to_dict() == trainer.cfg.to_dict()
    assert train.latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000002"
    changed = [n for n, p in trainer.policy.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "two steps of GRPO left every parameter unchanged"
    # the full-fine-tuning reference is a frozen copy of the starting weights
    ref = dict(trainer.ref.named_parameters())
    assert all(torch.equal(ref[n], before[n]) for n in ref)
    # the trained policy is saved as a Hugging Face folder that loads back to the same outputs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy").eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(tmp_path / "run" / "policy").encode("Where is my order?")])
    with torch.no_grad():
        assert torch.allclose(saved(ids).logits, trainer.policy.lm.eval()(ids).logits, atol=1e-5)


# Warm-up then cosine, so that a schedule restarted (or not restored) on resume changes the update.
SCHEDULED = dict(steps=3, lr_schedule="cosine", warmup_steps=7, eval_every=2, eval_tasks=1, save_every=1)


def test_resume_restores_the_learning_rate_schedule(tokenizer_dir, tmp_path):
    trainer = Trainer(_cfg(tokenizer_dir, tmp_path / "s", **SCHEDULED))
    trainer.run(max_steps=1)
    lr_after_one = trainer.optimizer.param_groups[0]["lr"]
    assert 0 < lr_after_one < trainer.cfg.lr and trainer.scheduler.last_epoch == 4  # 2 epochs x 2 mini-batches
    again = Trainer(_cfg(tokenizer_dir, tmp_path / "s", **SCHEDULED))
    assert again.try_resume() is not None and again.step_idx == 1
    assert again.scheduler.state_dict() == trainer.scheduler.state_dict()
    assert again.optimizer.param_groups[0]["lr"] == lr_after_one
    trainer.scheduler.step()
    again.scheduler.step()
    assert again.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()


def test_run_in_parts_on_one_trainer_is_one_run(tokenizer_dir, tmp_path):
    """run(max_steps=2) then run() on the same trainer ("max_steps more steps", no checkpoint between):
    the log and the weights of one run(), not a metrics.csv emptied by a second resume."""
    kw = dict(steps=4, save_every=3, eval_every=0, eval_tasks=1, ppo_epochs=1)
    whole = Trainer(_cfg(tokenizer_dir, tmp_path / "whole", **kw))
    whole.run()
    parts = Trainer(_cfg(tokenizer_dir, tmp_path / "parts", **kw))
    assert [r["step"] for r in parts.run(max_steps=2)] == [0, 1, 2]
    parts.run()
    assert list(_metrics(tmp_path / "parts")["step"]) == list(_metrics(tmp_path / "whole")["step"]) == [0, 1, 2, 3, 4]
    assert all(torch.equal(p, q) for p, q in zip(whole.policy.parameters(), parts.policy.parameters()))


@pytest.mark.slow
def test_resume_after_sigkill_at_any_point_is_the_uninterrupted_run(tokenizer_dir, tmp_path):
    """One run killed with SIGKILL three times, restarted each time with the same command: in the
    rollouts of step 1 (before any checkpoint), in the update of step 2, and while step 3's checkpoint
    is written. Rewards differ within a group
    (scored_trainer.py), the learning rate warms up then decays. The final weights, optimizer state,
    scheduler, data order and every logged metric equal the uninterrupted run's, bit for bit."""
    from scored_trainer import ScoredTrainer

    full = tmp_path / "full"
    ScoredTrainer(_cfg(tokenizer_dir, full, **SCHEDULED)).run()

    cut = tmp_path / "cut"
    config = tmp_path / "cut.json"
    config.write_text(json.dumps(_cfg(tokenizer_dir, cut, **SCHEDULED).to_dict()))
    ckpts = cut / "checkpoints"
    for point, at, resumes_from in [("rollout", 1, None), ("update", 2, 1), ("save", 3, 2)]:
        proc = run_script([config, point, at])
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr[-3000:])
        newest = train.latest_checkpoint(ckpts)
        assert (newest.name if newest else None) == (f"step_{resumes_from:08d}" if resumes_from else None), point
        assert not (cut / "policy").exists()
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp-")] == [".tmp-step_00000003"]
    done = run_script([config])
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]

    a, b = _metrics(cut), _metrics(full)
    compared = [c for c in train.METRIC_COLUMNS if c not in train.TIMING_COLUMNS]
    pd.testing.assert_frame_equal(a[compared], b[compared], check_exact=True)
    assert list(b["step"]) == [0, 1, 2, 3] and (b["pg_loss"].iloc[1:].abs() > 0).all()
    lr = b["lr"].iloc[1:].tolist()
    assert lr[0] < lr[1] and lr[1] > lr[2]  # step 1 ends inside the warm-up, then the cosine decay
    payload_a, rank_a = train.load_checkpoint(train.latest_checkpoint(ckpts))
    payload_b, rank_b = train.load_checkpoint(train.latest_checkpoint(full / "checkpoints"))
    assert payload_a["trainer"]["step"] == payload_b["trainer"]["step"] == 3
    for name, a_part, b_part in [("model", payload_a["model"], payload_b["model"]),
                                 ("optimizer", payload_a["optimizer"], payload_b["optimizer"]),
                                 ("rng", rank_a, rank_b)] + [
                                 (k, payload_a["trainer"][k], payload_b["trainer"][k])
                                 for k in ("scheduler", "sampler", "train_task_ids")]:
        flat_a, flat_b = _flatten(a_part), _flatten(b_part)
        assert flat_a.keys() == flat_b.keys() and flat_a, name
        differ = [k for k, v in flat_a.items() if not _same(v, flat_b[k])]
        assert not differ, (name, differ[:5])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def _flatten(tree, prefix: str = "") -> dict:
    """Nested dicts and lists of a state dict as {"a.b.0": leaf}."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def test_micro_batches_do_not_change_the_update(tokenizer_dir, tmp_path):
    """Rewards differ within a group (scored_trainer.py), so the policy-gradient term is not 0; splitting
    each mini-batch into micro-batches of 1 instead of 2 changes neither the metrics, nor the gradient of
    any optimizer step, nor the weights."""
    from scored_trainer import ScoredTrainer

    def gradients_at_each_update(trainer):
        seen = []
        trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
            {n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}))
        return seen

    ta = ScoredTrainer(_cfg(tokenizer_dir, tmp_path / "a", steps=1, micro_batch_size=2, eval_tasks=1))
    tb = ScoredTrainer(_cfg(tokenizer_dir, tmp_path / "b", steps=1, micro_batch_size=1, eval_tasks=1))
    ga, gb = gradients_at_each_update(ta), gradients_at_each_update(tb)
    a, b = ta.run()[-1], tb.run()[-1]
    assert a["pg_loss"] != 0
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "ratio_mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    # the gradient of every optimizer step: the same sums in another order, equal to float32 rounding
    assert len(ga) == len(gb) == ta.total_updates and all(x.keys() == y.keys() for x, y in zip(ga, gb))
    for x, y in zip(ga, gb):
        for n, g in x.items():
            assert torch.allclose(g, y[n], rtol=1e-4, atol=1e-5 * float(g.abs().max())), n
    wa, wb = dict(ta.policy.named_parameters()), dict(tb.policy.named_parameters())
    assert wa.keys() == wb.keys() == ga[0].keys()
    left_out = 0
    for n, p in wa.items():
        if n.endswith("k_proj.bias"):
            # a key bias has no gradient in exact arithmetic (softmax ignores a shift shared by all keys), so
            # Adam turns rounding noise into its steps: ~3e-6 apart after updates of ~4e-3
            assert torch.allclose(p, wb[n], rtol=1e-4, atol=1e-5), n
            continue
        # the same where the two runs' gradients of an entry differ by more than 1e-4 of it at some update
        # (rounding noise of a sum that nearly cancels, within the tensor's tolerance above): Adam divides a
        # gradient by its own size, so the noise becomes part of a step of up to lr (an embedding row of a
        # token the first update did not see: 5e-6 apart after updates of 1e-3, on one machine); those
        # weights are left out here, and they are few (0.3 % of the entries on that machine)
        noisy = torch.stack([(x[n] - y[n]).abs() > 1e-4 * x[n].abs() for x, y in zip(ga, gb)]).any(0)
        left_out += int(noisy.sum())
        assert torch.allclose(p[~noisy], wb[n][~noisy], rtol=1e-4, atol=1e-7), n
    assert left_out < 0.01 * sum(p.numel() for p in wa.values()), left_out


def test_lora_sinkflex_checkpointing_chunked_logprobs(tokenizer_dir, tmp_path):
    cfg = _cfg(tokenizer_dir, tmp_path / "lora", steps=1, lora=True, lora_r=4, attention="sinkflex",
               window=32, n_sink=2, gradient_checkpointing=True, logprob_chunk_size=64, tile_mlp_tokens=128)
    trainer = Trainer(cfg)
    trainable = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.endswith("sinkflex_sink_logits") for n in trainable)
    assert trainer.ref is None  # LoRA: the reference is the base model with the adapters disabled
    base_before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if not p.requires_grad}
    row = trainer.run()[-1]
    assert all(torch.isfinite(torch.tensor(row[k])) for k in ("loss", "kl", "entropy", "grad_norm"))
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.policy.named_parameters() if not p.requires_grad)
    # only what trains is checkpointed, and it loads back
    ckpt = train.latest_checkpoint(tmp_path / "lora" / "checkpoints")
    payload, _ = train.load_checkpoint(ckpt)
    assert set(payload["model"]) == {f"{n}" for n in trainable}
    again = Trainer(_cfg(tokenizer_dir, tmp_path / "lora", steps=1, lora=True, lora_r=4, attention="sinkflex",
                         window=32, n_sink=2, gradient_checkpointing=True, logprob_chunk_size=64,
                         tile_mlp_tokens=128))
    assert again.try_resume() == ckpt and again.step_idx == 1
    for n, p in again.policy.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, payload["model"][n]), n
    # the saved policy: peft adapters and the learned sink logits over a fresh base give the same log-probs
    from peft import PeftModel

    from sinkflex_core import attention

    folder = tmp_path / "lora" / "policy"
    assert (folder / "adapter_config.json").is_file() and (folder / "sink_logits.safetensors").is_file()
    base = train.load_model(TrainConfig.from_dict({**TINY, "tokenizer": tokenizer_dir, "attention": "sinkflex",
                                                   "window": 32, "n_sink": 2}), trainer.tokenizer, torch.device("cpu"))
    loaded = PeftModel.from_pretrained(base, folder)
    initial = [p.detach().clone() for p in attention.sink_parameters(loaded)]
    assert attention.load_sink_logits(loaded, folder) == TINY["num_layers"]
    trained = attention.sink_parameters(trainer.policy.lm)
    assert all(torch.equal(a, b) and not torch.equal(a, c)  # the trained sinks, which one step did move
               for a, b, c in zip(attention.sink_parameters(loaded), trained, initial))
    rows = train.concat_rollouts(trainer._collect([0], "train", 2, 1.0, ("probe",)), pad_id=0)
    with torch.no_grad():
        expect, _ = trainer.policy.eval()(rows["input_ids"], rows["attention_mask"], rows["position_ids"])
        got, _ = train.TokenLogprobs(loaded.eval())(rows["input_ids"], rows["attention_mask"], rows["position_ids"])
    real = rows["attention_mask"].bool()
    assert torch.allclose(got[real], expect[real], atol=1e-5)


def test_lora_reference_equals_the_base_model(tokenizer_dir, tmp_path):
    cfg = _cfg(tokenizer_dir, tmp_path / "ref", steps=1, lora=True, lora_r=4, lora_alpha=64, lr=0.05)
    trainer = Trainer(cfg)
    trainer.run()
    rows = train.concat_rollouts(trainer._collect([0], "train", 2, 1.0, ("probe",)), pad_id=0)
    ref = trainer._frozen_logprobs(rows, "ref")
    now = trainer._frozen_logprobs(rows, "old")
    base = train.load_model(TrainConfig.from_dict({**TINY, "tokenizer": tokenizer_dir}), trainer.tokenizer,
                            torch.device("cpu"))
    with torch.no_grad():
        expect, _ = train.TokenLogprobs(base)(rows["input_ids"], rows["attention_mask"], rows["position_ids"])
    real = rows["attention_mask"].bool()
    assert torch.allclose(ref[real], expect[real], atol=1e-5)
    assert not torch.allclose(now[real], expect[real], atol=1e-3)  # the adapters did move the policy


def test_config_that_cannot_be_split_across_processes_is_refused(tokenizer_dir, tmp_path):
    with pytest.raises(train.ConfigError, match="multiple of the number of processes"):
        Trainer(_cfg(tokenizer_dir, tmp_path / "x", tasks_per_step=3), train.Dist(rank=0, world=2))


def test_train_tasks_limits_the_sampled_tasks(tokenizer_dir, tmp_path):
    trainer = Trainer(_cfg(tokenizer_dir, tmp_path / "few", train_tasks=3, tasks_per_step=2, epochs=2.0, steps=0))
    assert trainer.num_train_tasks == 3 and trainer.total_steps == 3  # ceil(2 epochs x 3 tasks / 2)
    drawn = [t for _ in range(6) for t in trainer.sampler.next_batch()]
    assert sorted(drawn) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    with pytest.raises(train.ConfigError, match="train_tasks"):
        _cfg(tokenizer_dir, tmp_path / "bad", train_tasks=-1)


def _screen(path: Path, successes: list[int], tries: int = 4, split: str = "train") -> str:
    from sinkflex_core.envs.retail import REWARD_VERSION

    pd.DataFrame({"task": range(len(successes)), "successes": successes, "tries": tries, "split": split,
                  "reward_version": REWARD_VERSION}).to_csv(path, index=False)
    return str(path)


def test_task_screen_trains_only_on_tasks_solved_sometimes(tokenizer_dir, tmp_path):
    screen = _screen(tmp_path / "screen.csv", [0, 2, 4, 1, 0, 3, 0])  # tasks 1, 3 and 5: 0 < successes < 4
    assert train.screened_tasks(screen, "train", 600) == [1, 3, 5]
    trainer = Trainer(_cfg(tokenizer_dir, tmp_path / "s", task_screen=screen, epochs=2.0, steps=0, eval_every=0))
    assert trainer.train_task_ids == [1, 3, 5] and trainer.total_steps == 3  # ceil(2 epochs x 3 tasks / 2)
    rolled = []
    collect = trainer._collect

    def spy(tasks, split, *args):  # the real rollouts, with the task ids they were given noted
        rolled.extend(tasks if split == "train" else [])
        return collect(tasks, split, *args)

    trainer._collect = spy
    trainer.step()
    trainer.step()
    assert len(rolled) == 4 and set(rolled) <= {1, 3, 5}
    trainer.save()
    # The same config over a screen file that now selects other tasks is refused on resume.
    _screen(tmp_path / "screen.csv", [1, 1, 4, 1, 0, 3, 0])
    with pytest.raises(train.ConfigError, match="other tasks"):
        Trainer(_cfg(tokenizer_dir, tmp_path / "s", task_screen=screen, epochs=2.0, steps=0, eval_every=0)).run()
    # With train_tasks, only the first N tasks are screened.
    assert Trainer(_cfg(tokenizer_dir, tmp_path / "f", task_screen=screen, train_tasks=3)).train_task_ids == [0, 1]


@pytest.mark.parametrize("rows, split, message", [
    (None, "train", "no such file"),
    ({"task": [0], "successes": [1]}, "train", "missing column"),
    ({"task": [0], "successes": [1], "tries": [4], "split": ["test"]}, "train", "train_split is 'train'"),
    ({"task": [600], "successes": [1], "tries": [4]}, "train", r"in \[0, 600\)"),
    ({"task": [0], "successes": [5], "tries": [4]}, "train", "successes <= tries"),
    ({"task": [0, 0], "successes": [1, 2], "tries": [4, 4]}, "train", "more than one row"),
    ({"task": [0, 1], "successes": [0, 4], "tries": [4, 4]}, "train", "no task left"),
])
def test_task_screen_refuses_bad_files(tokenizer_dir, tmp_path, rows, split, message):
    path = tmp_path / "screen.csv"
    if rows is not None:  # made under the current reward: the error asked for, not a warning about the version
        pd.DataFrame(rows).assign(reward_version=train.reward_version()).to_csv(path, index=False)
    with pytest.raises(train.ConfigError, match=message):
        Trainer(_cfg(tokenizer_dir, tmp_path / "x", task_screen=str(path), train_split=split))


def test_resume_refuses_a_different_config(tokenizer_dir, tmp_path):
    Trainer(_cfg(tokenizer_dir, tmp_path / "r", steps=1, eval_tasks=1)).run()
    before = (tmp_path / "r" / "config.json").read_text()
    with pytest.raises(train.ConfigError, match="different config"):
        Trainer(_cfg(tokenizer_dir, tmp_path / "r", steps=2, eval_tasks=1, lr=5e-3)).run()
    assert (tmp_path / "r" / "config.json").read_text() == before  # still the run that is in the folder


def test_resume_refuses_a_start_policy_trained_again(tokenizer_dir, tmp_path, capfd):
    """The reference policy is read from cfg.model again on resume: other weights there since the
    checkpoint would change the KL term silently. (And a run with its progress off loads and saves a
    policy without transformers' bars, leaving them on for the caller.)"""
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    Trainer(_cfg(tokenizer_dir, tmp_path / "a", steps=1, eval_every=0, eval_tasks=1)).run()
    start = tmp_path / "a" / "policy"
    was = hf_logging.is_progress_bar_enabled()  # a command-line test before may have turned them off
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        Trainer(_cfg(tokenizer_dir, tmp_path / "b", model=str(start), steps=1, eval_every=0, eval_tasks=1)).run()
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "Writing model shards" not in err
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
    again = Trainer(_cfg(tokenizer_dir, tmp_path / "b", model=str(start), steps=2, eval_every=0, eval_tasks=1))
    assert again.try_resume() is not None and again.step_idx == 1  # the same start: resumed
    weights = load_file(start / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 0.01
    save_file(weights, start / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(train.ConfigError, match="other weights"):
        Trainer(_cfg(tokenizer_dir, tmp_path / "b", model=str(start), steps=2, eval_every=0,
                     eval_tasks=1)).try_resume()


def test_vllm_engine_gets_the_runs_precision_and_length(tokenizer_dir, tmp_path, monkeypatch):
    """The engine is built with the run's dtype and trajectory limit, not the backend's defaults
    (float32, 4,096 tokens), which would load a 7B policy at twice its size and refuse longer episodes.
    (The engine itself is tested in test_vllm_backend.py, where vLLM is installed.)"""
    from sinkflex_core import rollout

    made = {}

    class Recorder:
        stop_token_ids = [0]

        def __init__(self, model, tokenizer, **kwargs):
            made.update(kwargs)

    monkeypatch.setattr(rollout, "VLLMBackend", Recorder)
    Trainer(_cfg(tokenizer_dir, tmp_path / "v", rollout_backend="vllm", max_total_tokens=300, dtype="bfloat16"))
    assert made["dtype"] == "bfloat16" and made["max_model_len"] == 300


def test_a_fresh_run_replaces_the_checkpoints_of_an_earlier_one(tokenizer_dir, tmp_path):
    """resume=False into a used out_dir: the earlier run's later checkpoints must neither prune this
    run's nor be what a later restart resumes."""
    out = tmp_path / "f"
    Trainer(_cfg(tokenizer_dir, out, steps=3, eval_every=0, eval_tasks=1)).run()
    assert [p.name for p in train.list_checkpoints(out / "checkpoints")] == ["step_00000002", "step_00000003"]
    Trainer(_cfg(tokenizer_dir, out, steps=1, eval_every=0, eval_tasks=1, lr=5e-3, resume=False)).run()
    assert [p.name for p in train.list_checkpoints(out / "checkpoints")] == ["step_00000001"]
    again = Trainer(_cfg(tokenizer_dir, out, steps=1, eval_every=0, eval_tasks=1, lr=5e-3))
    assert again.try_resume() == out / "checkpoints" / "step_00000001" and again.step_idx == 1


def _torchrun_scored(cfg: TrainConfig, config_path: Path) -> subprocess.CompletedProcess:
    config_path.write_text(json.dumps(cfg.to_dict()))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).with_name("scored_trainer.py")), str(config_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_torchrun_two_processes_fsdp2_match_one_process(tokenizer_dir, tmp_path):
    """`torchrun --nproc_per_node 2` (gloo, FSDP2) against one process, same config, with rewards that
    differ within a group (scored_trainer.py), so that the policy-gradient term is in the update: the
    metrics and the updated weights agree. The two runs sum the same numbers in another order
    (micro-batches and the gradient reduce-scatter differ), so bitwise equality is not expected.
    Tolerance: metrics 1e-4 relative; every tensor's update (final minus initial weights) to 1% of
    its norm. Measured: 6e-4 on the key biases, whose gradient is zero in exact arithmetic (a key bias
    shifts all of a query's scores alike), so that Adam's normalisation turns rounding into steps;
    below 2e-5 on every other tensor."""
    from safetensors.torch import load_file
    from scored_trainer import ScoredTrainer

    two = _torchrun_scored(_cfg(tokenizer_dir, tmp_path / "two", steps=2, save_every=0), tmp_path / "two.json")
    assert two.returncode == 0, two.stderr[-3000:]
    one = ScoredTrainer(_cfg(tokenizer_dir, tmp_path / "one", steps=2, save_every=0))
    start = {n: p.detach().clone() for n, p in one.policy.lm.named_parameters()}
    one.run()
    a, b = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    info = pd.read_json(tmp_path / "two" / "run_info.json", typ="series")
    assert info["world_size"] == 2
    assert list(a["step"]) == list(b["step"]) == [0, 1, 2]
    # a nonzero advantage in every step: the policy-gradient term is part of what is compared
    assert (b["reward_std"].iloc[1:] > 0).all() and (b["pg_loss"].iloc[1:].abs() > 1e-4).all()
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "ratio_mean", "tokens_policy", "reward_mean"):
        pd.testing.assert_series_equal(a[key].iloc[1:], b[key].iloc[1:], rtol=1e-4, atol=1e-7, check_names=False)
    w2, w1 = load_file(tmp_path / "two" / "policy" / "model.safetensors"), \
        load_file(tmp_path / "one" / "policy" / "model.safetensors")
    assert w2.keys() == w1.keys() and set(w1) <= set(start)
    for n in w1:
        update = float((w1[n] - start[n]).norm())
        assert update > 0, f"{n} was not trained"
        assert float((w2[n] - w1[n]).norm()) <= 1e-2 * update, (n, float((w2[n] - w1[n]).norm()) / update)


def test_time_budget_stops_after_the_evaluation_that_used_it_up(tokenizer_dir, tmp_path):
    """max_minutes: a step that ends past the budget gets the final evaluation; an evaluation that
    itself crosses the budget is the final one (no further step and second evaluation)."""
    cfg = _cfg(tokenizer_dir, tmp_path / "t", steps=10, eval_every=2, save_every=0, max_minutes=125 / 60)
    trainer = Trainer(cfg)
    clock = {"t": 0.0}
    evals = []

    def fake_step():
        clock["t"] += 10.0
        trainer.step_idx += 1
        return {"step": trainer.step_idx}

    def fake_evaluate():
        clock["t"] += 100.0
        evals.append(trainer.step_idx)
        return {"eval_reward": 0.0}

    trainer.step, trainer.evaluate = fake_step, fake_evaluate
    trainer.elapsed = lambda: clock["t"]
    trainer.run()
    # step 0 eval -> 100 s; step 1 -> 110 s; step 2 -> 120 s (< 125), its due eval -> 220 s: stop there
    assert evals == [0, 2] and trainer.step_idx == 2
    # a budget that a step (not an eval) crosses: step 3 ends at 230 s > 225 s -> final eval at step 3
    trainer2 = Trainer(_cfg(tokenizer_dir, tmp_path / "u", steps=10, eval_every=2, save_every=0,
                            max_minutes=225 / 60))
    clock["t"], evals[:] = 0.0, []
    trainer = trainer2
    trainer2.step, trainer2.evaluate = fake_step, fake_evaluate
    trainer2.elapsed = lambda: clock["t"]
    trainer2.run()
    assert evals == [0, 2, 3] and trainer2.step_idx == 3
    # the first run again, as it was launched: it resumes at step 2 with 220 s used of 125 and stops there
    evals[:] = []
    trainer = Trainer(cfg)
    trainer.step, trainer.evaluate = fake_step, fake_evaluate
    trainer.run()
    assert evals == [] and trainer.step_idx == 2 and (tmp_path / "t" / "policy" / "config.json").is_file()


@pytest.mark.slow
def test_torchrun_ranks_stop_together_at_the_time_budget(tokenizer_dir, tmp_path):
    """max_minutes under torchrun, rank 1's clock started 3 s after rank 0's (its set-up took longer):
    the ranks must agree on when the budget is used up. If each read its own clock, rank 0 would
    evaluate, save and stop while rank 1 stepped on, and the run would die on mismatched collectives."""
    cfg = _cfg(tokenizer_dir, tmp_path / "b", steps=200, save_every=0, eval_every=0, eval_tasks=1, ppo_epochs=1,
               max_minutes=4 / 60)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(cfg.to_dict()))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).with_name("skewed_trainer.py")), str(path), "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    df = _metrics(tmp_path / "b")
    last = int(df["step"].iloc[-1])
    assert 0 < last < 200 and pd.notna(df["eval_reward"].iloc[-1])  # stopped on the budget, with its evaluation
    assert train.latest_checkpoint(tmp_path / "b" / "checkpoints").name == f"step_{last:08d}"
    assert (tmp_path / "b" / "policy" / "model.safetensors").is_file()


def test_drop_uniform_groups_skips_a_step_without_signal(tokenizer_dir, tmp_path):
    """A random policy solves nothing: every group's rewards are equal, so with drop_uniform_groups
    the step takes no optimizer step and logs no loss (the policy is unchanged)."""
    trainer = Trainer(_cfg(tokenizer_dir, tmp_path / "d", steps=2, drop_uniform_groups=True, eval_tasks=1,
                           lr_schedule="cosine"))
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    row = trainer.step()
    assert row["frac_groups_all_equal"] == 1.0 and row["trajectories_updated"] == 0
    assert row["loss"] is None and row["kl"] is None and row["grad_norm"] is None
    assert all(torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())
    # the schedule moved on all the same: half of the cosine (4 of 8 mini-batch slots) is behind it
    assert row["lr"] == pytest.approx(0.5 * trainer.cfg.lr)


def test_drop_uniform_groups_is_the_update_on_the_groups_with_signal_alone(tokenizer_dir, tmp_path):
    """Real rollouts, rewards set by the test (scored_trainer.py): one group of two has a signal.
    Dropping the other group gives the same update as a batch holding that group alone, and not the
    update over both groups (whose KL and normalisers include the uniform one)."""
    from scored_trainer import ScoredTrainer

    def one_step(name: str, drop: bool, alone: bool):
        trainer = ScoredTrainer(_cfg(tokenizer_dir, tmp_path / name, steps=1, drop_uniform_groups=drop,
                                     entropy_coef=0.0, ppo_epochs=1))
        trainer.keep_signal_group_only = alone
        row = trainer.step()
        return row, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}

    dropped, w_dropped = one_step("dropped", True, False)
    alone, w_alone = one_step("alone", False, True)
    both, w_both = one_step("both", False, False)
    assert dropped["trajectories_updated"] == alone["trajectories_updated"] == 2 and both["trajectories_updated"] == 4
    assert dropped["frac_groups_all_equal"] == 0.5 and dropped["reward_mean"] == 0.25
    for key in ("loss", "pg_loss", "kl", "grad_norm"):
        assert dropped[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-8), key
    assert abs(dropped["loss"] - both["loss"]) > 1e-4 * abs(dropped["loss"])
    for n in w_dropped:
        torch.testing.assert_close(w_dropped[n], w_alone[n], rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(w_dropped[n], w_both[n]) for n in w_dropped)


@pytest.mark.slow
def test_drop_uniform_groups_under_torchrun_when_one_rank_has_nothing_to_learn(tokenizer_dir, tmp_path):
    """Two processes (gloo, FSDP2), the group with a signal on rank 0 only: rank 1 runs zero-weighted
    micro-batches to keep FSDP's collectives in step, and the run matches one process."""
    script = Path(__file__).with_name("scored_trainer.py")
    runs = {}
    for nproc in (2, 1):
        cfg = _cfg(tokenizer_dir, tmp_path / f"p{nproc}", steps=2, save_every=0, drop_uniform_groups=True,
                   eval_tasks=1)
        path = tmp_path / f"p{nproc}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] \
            if nproc == 2 else [sys.executable]
        done = subprocess.run([*launcher, str(script), str(path)], cwd=ROOT, capture_output=True, text=True,
                              timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        runs[nproc] = _metrics(tmp_path / f"p{nproc}")
    a, b = runs[2], runs[1]
    assert list(a["trajectories_updated"].iloc[1:]) == list(b["trajectories_updated"].iloc[1:]) == [2, 2]
    assert (a["loss"].iloc[1:].abs() > 1e-4).all()
    for key in ("loss", "kl", "entropy", "grad_norm", "ratio_mean", "reward_mean"):
        pd.testing.assert_series_equal(a[key].iloc[1:], b[key].iloc[1:], rtol=1e-4, atol=1e-7, check_names=False)


def test_one_update_is_a_gradient_descent_step_on_the_grpo_loss_of_the_trained_rows():
    """grpo_update with plain SGD, one epoch, one mini-batch cut into uneven micro-batches and one row
    left out: the weights move by exactly -lr x the gradient of grpo_loss over the trained rows,
    computed here in one plain forward. A step up the gradient, a sign lost on the advantages, a term
    dropped (KL, entropy) or a row trained that should not be all change that step."""
    from sinkflex_core import grpo
    from sinkflex_core.models import build_model, tiny_qwen2_config
    from sinkflex_core.train import update

    lm = build_model(tiny_qwen2_config(vocab_size=64, hidden_size=32, num_layers=1), seed=3)
    policy = train.TokenLogprobs(lm, entropy_grad=True)
    g = torch.Generator().manual_seed(0)
    lengths = [9, 14, 6, 11]
    B, L = len(lengths), max(lengths)
    ids = torch.randint(1, 64, (B, L), generator=g)
    attention = torch.zeros(B, L, dtype=torch.long)
    loss_mask = torch.zeros(B, L, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
        attention[b, :n] = 1
        loss_mask[b, 3:n] = 1
        loss_mask[b, 5:7] = 0  # an environment reply between two policy turns
    positions = torch.arange(L).expand(B, L).clone()
    with torch.no_grad():
        logp, _ = policy(ids, attention, positions)
    noise = torch.randn(2, B, L, generator=g)
    old = (logp + 0.3 * noise[0]) * loss_mask  # ratios away from 1: some tokens clipped
    ref = (logp + 0.5 * noise[1]) * loss_mask
    rows = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "old_logprobs": old,
            "position_ids": positions, "group_ids": torch.tensor([0, 0, 1, 1])}
    advantages = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.2, 0.9]), rows["group_ids"])
    train_rows = torch.tensor([True, False, True, True])
    cfg = TrainConfig(ppo_epochs=1, num_minibatches=1, micro_batch_size=2, grad_clip=0.0, kl_coef=0.5,
                      entropy_coef=0.05, clip_low=0.2, clip_high=0.28, max_total_tokens=32)
    lr = 0.1
    params = [p for p in policy.parameters() if p.requires_grad]
    # the expected step: the loss of the trained rows alone, in one forward, with their own counts
    keep = train_rows.nonzero().flatten()
    policy.train()
    logp_k, ent_k = policy(ids[keep], attention[keep], positions[keep])
    loss, _ = grpo.grpo_loss(logp_k, old[keep], advantages[keep], loss_mask[keep], ref_logp=ref[keep],
                             entropy=ent_k, config=update.loss_config(cfg), norm_length=cfg.max_total_tokens)
    expected = [-lr * gr for gr in torch.autograd.grad(loss, params)]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    acc = update.grpo_update(policy, optimizer, scheduler, rows, advantages, train_rows, ref, cfg, train.Dist())
    assert acc["updates"] == 1
    assert acc["tokens"] == int(loss_mask[keep].sum())
    assert acc["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    step = [p.detach() - b for p, b in zip(params, before)]
    total = torch.cat([e.flatten() for e in expected]).norm()
    assert total > 0
    err = torch.cat([(s - e).flatten() for s, e in zip(step, expected)]).norm()
    assert err <= 1e-4 * total, float(err / total)
