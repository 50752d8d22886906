"""The trainer's parts that need no model: config and command line, data order, crash-safe
checkpoints (a real process killed with SIGKILL while writing), the metrics log, batch plumbing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from sinkflex_core import train
from sinkflex_core.train import (
    ConfigError,
    MetricsLog,
    TaskSampler,
    TrainConfig,
    latest_checkpoint,
    load_checkpoint,
    resolve_config,
    save_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# config


def test_presets_hold_the_paper_settings():
    paper = resolve_config("paper-8xh100")
    assert (paper.model, paper.lr, paper.tasks_per_step, paper.group_size, paper.kl_coef, paper.epochs,
            paper.max_total_tokens) == ("Qwen/Qwen2.5-7B-Instruct", 5e-6, 32, 8, 0.04, 3.0, 8192)
    assert paper.rollout_backend == "vllm" and paper.lora and paper.attention == "sinkflex"
    tiny = resolve_config()
    assert tiny.preset == "tiny-cpu" and tiny.model == "tiny" and tiny.rollout_backend == "hf"


def test_vllm_sampling_of_a_sink_policy_must_be_chosen():
    # vLLM samples with full attention: with sink attention in training that is off-policy, so the
    # paper preset says so explicitly and a config that does not is refused before any model loads
    assert resolve_config("paper-8xh100").vllm_full_attention
    with pytest.raises(ConfigError, match="vllm_full_attention"):
        resolve_config("paper-8xh100", {"vllm_full_attention": False})
    assert resolve_config("paper-8xh100", {"vllm_full_attention": False, "rollout_backend": "hf"}).attention \
        == "sinkflex"


def test_cli_overrides_flags_and_set(tmp_path):
    cfg, _ = train.config_from_argv(["--lr", "1e-4", "--group-size", "4", "--set", "kl_coef=0.1",
                                     "--set", "lora_targets=q_proj,v_proj", "--no-progress", "--lora"])
    assert cfg.lr == 1e-4 and cfg.group_size == 4 and cfg.kl_coef == 0.1
    assert cfg.lora_targets == ("q_proj", "v_proj") and cfg.progress is False and cfg.lora is True
    # a saved config.json round-trips, with overrides on top
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    again, _ = train.config_from_argv(["--config", str(path), "--seed", "3"])
    assert again.to_dict() == {**cfg.to_dict(), "seed": 3}


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "lr must be a positive number"),
    (["--group-size", "1"], "group_size must be >= 2"),
    (["--group-size", "four"], "cannot read 'four' as int"),
    (["--set", "nope=1"], "unknown config key 'nope'"),
    (["--set", "lr"], "KEY=VALUE"),
    (["--attention", "flash"], "attention must be one of"),
    (["--num-minibatches", "9", "--group-size", "4"], "num_minibatches (9) must be <= group_size (4)"),
    (["--clip-low", "1.5"], "clip_low must be in [0, 1)"),
    (["--steps", "2.5"], "cannot read '2.5' as int"),
    (["--steps", "inf"], "cannot read 'inf' as int"),
    (["--epochs", "inf", "--steps", "0"], "epochs must be a finite number"),
    (["--seed", "-1"], "seed must be an integer >= 0"),
    (["--set", "seed=1e30"], "seed must be below 2**63"),
    # inf passes a ">= 0" check, then turns the loss (kl_coef, entropy_coef) or the weights (weight_decay) into nan
    (["--set", "kl_coef=inf"], "kl_coef must be a finite number, got inf"),
    (["--set", "entropy_coef=inf"], "entropy_coef must be a finite number"),
    (["--weight-decay", "inf"], "weight_decay must be a finite number"),
    (["--epochs", "-1"], "epochs must be >= 0, got -1.0"),
    # a preset as a key relabelled the other preset's values instead of loading its own
    (["--set", "preset=paper-8xh100"], "--preset paper-8xh100"),
])
def test_bad_config_values_get_clear_errors(argv, message):
    with pytest.raises(ConfigError, match=None) as err:
        train.config_from_argv(argv)
    assert message in str(err.value)


def test_integer_keys_are_read_exactly():
    # a long seed was read through a float and rounded to another seed
    cfg, _ = train.config_from_argv(["--set", "seed=1234567890123456789", "--set", "steps=1e3", "--group-size", "8.0"])
    assert (cfg.seed, cfg.steps, cfg.group_size) == (1234567890123456789, 1000, 8)
    for text in ("1e400000000", "1.000001"):
        with pytest.raises(ConfigError, match="as int"):
            train.config_from_argv(["--set", f"steps={text}"])


def test_a_config_built_in_code_with_a_value_of_the_wrong_kind_is_refused_by_name():
    # TrainConfig(...) in a notebook reaches the trainer through validate() alone, not from_dict
    for values, message in (({"lr": "1e-4"}, "lr must be a number, got '1e-4'"),
                            ({"temperature": "1"}, "temperature must be a number"),
                            ({"window": "768"}, "window must be an integer"),
                            ({"progress": 1}, "progress must be true or false")):
        with pytest.raises(ConfigError) as err:
            TrainConfig(**values).validate()
        assert message in str(err.value), (values, str(err.value))


def test_config_files_and_run_folders_are_read_or_refused_by_name(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**resolve_config("tiny-cpu").to_dict(), "steps": 7}))
    assert train.config_from_argv(["--config", str(run)])[0].steps == 7  # a run folder: its config.json
    # strings in the file are read as on the command line; values of another kind are refused by key
    (tmp_path / "s.json").write_text(json.dumps({"lr": "1e-4", "preset": "tiny-cpu"}))
    assert train.config_from_argv(["--config", str(tmp_path / "s.json")])[0].lr == 1e-4
    bad = {"missing.json": None, "broken.json": '{"lr": 1e-4,', "list.json": "[1, 2]",
           "kind.json": json.dumps({"steps": 2.5}), "flag.json": json.dumps({"progress": 1}),
           "none.json": json.dumps({"lr": None}), "key.json": json.dumps({"nope": 1}),
           "targets.json": json.dumps({"lora_targets": 5}), "targets_none.json": json.dumps({"lora_targets": None})}
    messages = {"missing.json": "no such file", "broken.json": "not a JSON file", "list.json": "a JSON object",
                "kind.json": "steps must be an integer, got 2.5", "flag.json": "progress must be true or false",
                "none.json": "lr must not be None", "key.json": "unknown config key",
                "targets.json": "lora_targets must be module names", "targets_none.json": "lora_targets must be"}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as err:
            train.config_from_argv(["--config", str(tmp_path / name)])
        assert messages[name] in str(err.value), (name, str(err.value))
    assert train.main(["--config", str(tmp_path / "broken.json")]) == 2
    # a preset beside the file was ignored: the values would not be the ones the command line names
    for preset in (["--preset", "paper-8xh100"], ["--set", "preset=paper-8xh100"]):
        with pytest.raises(ConfigError, match="pass one"):
            train.config_from_argv(["--config", str(run), *preset])


def test_a_misspelt_split_is_refused_before_the_run_folder_is_made(tmp_path):
    out = tmp_path / "run"
    cfg = resolve_config("tiny-cpu", {"eval_split": "valid", "out_dir": str(out), "model": "tiny"})
    with pytest.raises(ConfigError, match="split 'valid'"):
        train.Trainer(cfg)
    assert not out.exists()


def test_a_missing_model_folder_is_refused_before_the_run_folder_is_made(tmp_path):
    out = tmp_path / "run"
    cfg = resolve_config("tiny-cpu", {"model": str(tmp_path / "no-such-model"), "tokenizer": "tiny",
                                      "out_dir": str(out), "layer_sinks": ""})
    with pytest.raises(ConfigError, match="cannot load model"):
        train.Trainer(cfg)
    assert not out.exists()


def test_main_reports_config_errors_with_exit_code_2(capsys):
    assert train.main(["--kl-kind", "k9"]) == 2
    assert "kl_kind must be one of" in capsys.readouterr().err


def test_print_config_gives_a_torchrun_command(capsys):
    assert train.main(["--preset", "paper-8xh100", "--group-size", "4", "--print-config"]) == 0
    out = capsys.readouterr().out
    cmd = out.strip().splitlines()[-1]
    assert cmd.startswith("torchrun --standalone --nproc_per_node 8 -m sinkflex_core.train --preset paper-8xh100")
    assert "--set group_size=4" in cmd
    printed = json.loads(out[:out.index("\n# on one node")])
    assert printed["group_size"] == 4 and printed["lr"] == 5e-6


def test_torchrun_command_reads_back_to_the_same_config():
    """Every value survives the shell: an unset optional field (``none``) and a text with quotes."""
    import shlex

    assert train.config_from_argv(["--set", "system_prompt=none"])[0].system_prompt is None
    assert train.config_from_argv(["--set", "system_prompt=None"])[0].system_prompt is None
    # the same rule for SFTConfig, whose command line reads its values with the same function
    import dataclasses

    from sinkflex_core.sft import SFTConfig

    field = {f.name: f for f in dataclasses.fields(SFTConfig)}["system_prompt"]
    assert train.is_optional(field) and SFTConfig().system_prompt is not None
    assert train.parse_value(SFTConfig().system_prompt, "none", optional=True) is None
    assert train.parse_value("text", "none") == "none"  # a plain str field keeps the word
    for preset, prompt in (("tiny-cpu", None), ("paper-8xh100", "Don't say \"$HOME\"; be brief."),
                           ("tiny-cpu", "none of that")):
        cfg = train.resolve_config(preset, {"system_prompt": prompt, "lora_targets": "q_proj,v_proj"})
        words = shlex.split(train.torchrun_command(cfg, nproc_per_node=2))
        again, _ = train.config_from_argv(words[words.index("sinkflex_core.train") + 1:])
        assert again.to_dict() == cfg.to_dict()


def test_rollout_config_carries_the_runs_rollout_settings():
    cfg = train.resolve_config("tiny-cpu", {"max_turns": 5, "max_total_tokens": 700, "max_new_tokens_per_turn": 33,
                                            "temperature": 0.7, "top_p": 0.9, "group_size": 3,
                                            "include_tools": True, "system_prompt": "hi"})
    r = train.rollout_config(cfg, seed=11)
    assert (r.group_size, r.max_turns, r.max_total_tokens, r.max_new_tokens_per_turn) == (3, 5, 700, 33)
    assert (r.temperature, r.top_p, r.seed, r.system_prompt, r.include_tools) == (0.7, 0.9, 11, "hi", True)
    e = train.rollout_config(cfg, seed=2, group_size=1, temperature=1.0)  # an evaluation's
    assert (e.group_size, e.temperature, e.max_turns) == (1, 1.0, 5)


def test_total_steps_from_epochs():
    cfg = TrainConfig(tasks_per_step=8, epochs=3.0, steps=0)
    assert cfg.total_steps(num_train_tasks=20) == 8  # ceil(3 * 20 / 8)
    assert TrainConfig(steps=5).total_steps(1000) == 5


# --------------------------------------------------------------------------------------------------
# data order


def test_sampler_covers_every_task_once_per_epoch_and_resumes_exactly():
    s = TaskSampler(num_tasks=10, batch=4, seed=7)
    drawn = [s.next_batch() for _ in range(5)]  # 20 tasks = 2 epochs
    flat = [t for b in drawn for t in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new order each epoch
    # restore mid-way: the rest of the sequence is the same
    s2 = TaskSampler(10, 4, seed=7)
    s2.next_batch()
    state = s2.state_dict()
    s3 = TaskSampler(10, 4, seed=7)
    s3.load_state_dict(state)
    assert [s3.next_batch() for _ in range(4)] == drawn[1:]
    with pytest.raises(ValueError, match="does not match"):
        TaskSampler(11, 4, seed=7).load_state_dict(state)


def test_derived_seeds_are_stable_and_distinct():
    assert train.derive_seed(0, "train", 1, 0) == train.derive_seed(0, "train", 1, 0)
    assert len({train.derive_seed(0, "train", s, p) for s in range(5) for p in range(5)}) == 25
    # stable across processes too: Python's salted hash() would differ under another PYTHONHASHSEED
    parts = [(0, "train", 1, 0), (7, "eval", "task-3", 2)]
    here = [train.derive_seed(*p) for p in parts]
    code = f"from sinkflex_core import train; print([train.derive_seed(*p) for p in {parts!r}])"
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == here, hash_seed


# --------------------------------------------------------------------------------------------------
# checkpoints


def _payload(value: float) -> dict:
    return {"model": {"w": torch.full((64,), value)}, "optimizer": {"m": torch.full((64,), -value)},
            "trainer": {"step": int(value)}}


def test_checkpoint_roundtrip_latest_and_pruning(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _payload(step), rank_payload={"rng": train.rng_state()}, keep=2)
    assert [p.name for p in train.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000003"
    payload, rank = load_checkpoint(latest)
    assert torch.equal(payload["model"]["w"], torch.full((64,), 3.0)) and "rng" in rank
    # a damaged newest checkpoint is skipped in favour of the previous one
    (latest / "model.pt").write_bytes(b"garbage")
    assert latest_checkpoint(tmp_path).name == "step_00000002"


def test_a_flipped_byte_is_caught_by_the_hash_alone(tmp_path):
    """Bit rot or a torn write that keeps the file's size: only the SHA-256 in the manifest can tell."""
    for step in (1, 2):
        save_checkpoint(tmp_path, step, _payload(step), keep=2)
    newest = tmp_path / "step_00000002"
    target = newest / "model.pt"
    data = bytearray(target.read_bytes())
    size = len(data)
    data[size // 2] ^= 0x01
    target.write_bytes(bytes(data))
    assert target.stat().st_size == size
    assert train.verify_checkpoint(newest, check_hashes=False)  # sizes alone cannot see it
    assert not train.verify_checkpoint(newest)
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_rng_state_roundtrip():
    state = train.rng_state()
    a = (torch.rand(3), torch.randn(2))
    train.set_rng_state(state)
    b = (torch.rand(3), torch.randn(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


_CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from sinkflex_core import train
    from sinkflex_core.train import checkpoint

    root, where = sys.argv[1], sys.argv[2]
    def payload(v):
        return {"model": {"w": torch.full((4096,), v)}, "optimizer": {"m": torch.full((4096,), -v)},
                "trainer": {"step": int(v)}}
    train.save_checkpoint(root, 1, payload(1.0), rank_payload={"rng": 1})
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "payload":  # killed after the first payload file is written
        real = torch.save
        def save_then_die(obj, f, *a, **k):
            real(obj, f, *a, **k)
            if str(f).endswith("model.pt"):
                die()
        torch.save = save_then_die
    elif where == "rename":  # everything written and fsynced, killed just before the folder is renamed
        checkpoint.os.rename = die
    elif where == "pointer":  # folder renamed, killed before `latest` is switched
        checkpoint.os.replace = die
    elif where == "prune":  # new checkpoint complete, killed while removing the old one
        checkpoint.shutil.rmtree = die
    train.save_checkpoint(root, 2, payload(2.0), rank_payload={"rng": 2}, keep=1)
    print("not killed")
""")


@pytest.mark.parametrize("where, expected_step", [("payload", 1), ("rename", 1), ("pointer", 1), ("prune", 2)])
def test_sigkill_while_writing_never_corrupts_the_last_checkpoint(tmp_path, where, expected_step):
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_SCRIPT)
    root = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(script), str(root), where], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    path = latest_checkpoint(root)
    assert path is not None and path.name == f"step_{expected_step:08d}"
    payload, rank = load_checkpoint(path)
    assert torch.equal(payload["model"]["w"], torch.full((4096,), float(expected_step)))
    assert rank == {"rng": expected_step}
    # the next save still works and leaves no temporary folder behind
    save_checkpoint(root, 3, _payload(3.0), keep=1)
    assert latest_checkpoint(root).name == "step_00000003"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]


# --------------------------------------------------------------------------------------------------
# metrics log and batch plumbing


def test_metrics_log_is_pandas_readable_and_truncates_on_resume(tmp_path):
    log = MetricsLog(tmp_path / "metrics.csv")
    for step in range(4):
        log.write({"step": step, "reward_mean": 0.1 * step, "eval_reward": 0.5 if step == 0 else None})
    log.truncate_after(2)
    log.write({"step": 3, "reward_mean": 0.9})
    df = pd.read_csv(tmp_path / "metrics.csv")
    assert list(df["step"]) == [0, 1, 2, 3] and df["reward_mean"].iloc[-1] == 0.9
    assert list(df.columns) == train.METRIC_COLUMNS
    assert df["eval_reward"].isna().tolist() == [False, True, True, True]


class _FakeBatch:
    """The fields of a RolloutBatch that concat_rollouts reads (plain tensors)."""

    def __init__(self, width: int, groups: list[int], reward: float):
        b = len(groups)
        self.input_ids = torch.arange(b * width).reshape(b, width)
        self.attention_mask = torch.ones(b, width, dtype=torch.long)
        self.loss_mask = torch.ones(b, width, dtype=torch.long)
        self.old_logprobs = torch.full((b, width), -1.0)
        self.position_ids = torch.arange(width).expand(b, width)
        self.group_ids = torch.tensor(groups)
        self.rewards = torch.full((b,), reward)
        self.stats = [{"turns": 1}] * b


def test_concat_rollouts_pads_and_keeps_groups_apart():
    rows = train.concat_rollouts([_FakeBatch(3, [5, 5, 9, 9], 1.0), _FakeBatch(5, [5, 5], 0.0)], pad_id=0)
    assert rows["input_ids"].shape == (6, 5)
    assert rows["attention_mask"][:4, 3:].sum() == 0 and rows["attention_mask"][4:].sum() == 10
    assert rows["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert train.position_in_group(rows["group_ids"]).tolist() == [0, 1, 0, 1, 0, 1]
    trimmed = train.trim_rows(rows, torch.tensor([0, 1]))
    assert trimmed["input_ids"].shape == (2, 3)


def test_per_task_rewards_follows_group_order():
    b = _FakeBatch(2, [3, 3, 1, 1], 0.0)
    b.rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    assert train.per_task_rewards([b], tasks=[10, 11], first_pos=4) == {4: [1.0, 0.0], 5: [0.5, 0.5]}


def test_module_runs_under_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "sinkflex_core.train", "--print-config"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ})
    assert out.returncode == 0 and "torchrun" in out.stdout


def test_reward_curve_plot_averages_only_shared_evaluations_and_marks_each_seeds_end():
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np

    df = pd.DataFrame({"seed": [0, 0, 0, 1, 1, 1, 1], "step": [0, 4, 6, 0, 4, 6, 8],
                       "eval_reward": [0.1, 0.2, 0.3, 0.3, 0.4, 0.1, 0.9], "elapsed_s": [0, 60, 90, 0, 60, 90, 120]})
    ax = train.plot_reward_curves(df, label="run:")
    mean = next(line for line in ax.lines if "mean of 2 seeds" in line.get_label())
    assert list(mean.get_xdata()) == [0, 4, 6] and np.allclose(mean.get_ydata(), [0.2, 0.3, 0.2])
    end = next(line for line in ax.lines if "last evaluation" in line.get_label())
    assert np.allclose(end.get_xdata(), [7.0]) and np.allclose(end.get_ydata(), [0.6])
    assert "0.600" in end.get_label()


def _two_seeds():
    # seed 1's last row has no evaluation: its end is its last evaluation (step 6), not its last step
    return pd.DataFrame({"seed": [0, 0, 0, 1, 1, 1, 1], "step": [0, 4, 8, 0, 4, 6, 7],
                         "eval_reward": [0.1, 0.2, 0.3, 0.3, 0.4, 0.1, None],
                         "eval_pass1": [0.1, 0.2, 0.3, 0.3, 0.4, 0.1, None],
                         "eval_passk": [0.0, 0.1, 0.2, 0.2, 0.3, 0.0, None],
                         "elapsed_s": [0, 60, 120, 0, 60, 90, 100], "parameters": 1.6e6})


def test_evaluations_and_summary_take_each_seeds_last_evaluation_as_its_end():
    df = _two_seeds()
    ev = train.evaluations(df.sample(frac=1.0, random_state=0))  # any row order
    assert list(zip(ev["seed"], ev["step"], ev["last_eval"])) == [
        (0, 0, False), (0, 4, False), (0, 8, True), (1, 0, False), (1, 4, False), (1, 6, True)]
    s = train.summarize_curves(df).set_index("seed")
    assert s.loc[0, "end"] == 0.3 and s.loc[1, "end"] == 0.1 and s.loc[1, "steps"] == 7
    assert s.loc[1, "gain"] == pytest.approx(-0.2) and s.loc[1, "best"] == 0.4
    assert s.loc["mean", "gain"] == pytest.approx(0.0) and s.loc["mean", "start"] == pytest.approx(0.2)


def test_reward_figure_draws_each_attentions_runs_their_test_gains_and_a_run_of_ones_own():
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    curve = pd.DataFrame({"attention": ["sinkflex"] * 6 + ["sdpa"] * 6, "seed": [0, 0, 0, 1, 1, 1] * 2,
                          "step": [0, 1, 2] * 4, "parameters": 1.6e6,
                          "reward_mean": [None, 0.1, 0.3, None, 0.3, 0.5, None, 0.2, 0.2, None, 0.0, 0.2]})
    test = pd.concat([_test_table([0, 4], [4, 4], attention="sinkflex"), _test_table([0, 4], [0, 4], attention="sdpa")])
    test = test.assign(start_rate=test["start_successes"] / 4, end_rate=test["end_successes"] / 4)
    live = curve[(curve["attention"] == "sinkflex") & (curve["seed"] == 0)].drop(columns="attention")
    fig = train.reward_figure(curve, test, live)
    steps_ax, test_ax = fig.axes
    mean = next(line for line in steps_ax.lines if line.get_label() == "sinkflex: mean of 2 seeds")
    assert list(mean.get_xdata()) == [1, 2] and np.allclose(mean.get_ydata(), [0.2, 0.4])
    labels = [line.get_label() for line in steps_ax.lines]
    assert "sdpa: mean of 2 seeds" in labels and "this run: seed 0" in labels
    assert any(label.startswith("paper, end: 0.44") for label in labels)
    assert "screened" not in steps_ax.get_title() and not any("all its training tasks" in x for x in labels)
    screened = train.reward_figure(curve.assign(task_screen="data/retail-tiny-start/train_screen.csv")).axes[0]
    assert "screened" in screened.get_title()  # its reward is on the tasks the start solved, the paper's on all
    assert any(x.startswith("paper, end: 0.44") and "all its training tasks" in x
               for x in (line.get_label() for line in screened.lines))
    legend = [t.get_text() for t in test_ax.get_legend().get_texts()]
    # sinkflex: task 0 goes 0 -> 1, task 1 stays at 1: 0.5 -> 1.0; sdpa: no change
    assert any(t.startswith("sinkflex: 0.500 -> 1.000, gain +0.500") for t in legend)
    assert any(t.startswith("sdpa: 0.500 -> 0.500, gain +0.000 [+0.000, +0.000]") for t in legend)
    assert "1.6M parameters" in fig._suptitle.get_text()
    # no data at all: the empty panels with the paper's lines, no error
    assert len(train.reward_figure().axes) == 2


def _test_table(start, end, attention="sinkflex", seeds=(0,), tries=4):
    rows = [{"attention": attention, "seed": s, "task": t, "start_successes": a, "end_successes": b, "tries": tries}
            for s in seeds for t, (a, b) in enumerate(zip(start, end[s] if isinstance(end, dict) else end))]
    return pd.DataFrame(rows)


def test_paired_gains_per_seed_and_over_seeds_with_a_paired_interval():
    # two tasks: start 0/4 and 2/4; seed 0 ends 2/4 and 2/4 (+0.25), seed 1 ends 0/4 and 4/4 (+0.25)
    test = _test_table([0, 2], {0: [2, 2], 1: [0, 4]}, seeds=(0, 1))
    g = train.paired_gains(test, draws=2000).set_index("seed")
    assert g.loc[0, "start"] == 0.25 and g.loc[0, "end"] == 0.5 and g.loc[0, "gain"] == 0.25
    # seed 0 gains 0.5 on task 0 and 0 on task 1: the resampled mean lies in [0, 0.5] and reaches both
    assert g.loc[0, "low"] == 0.0 and g.loc[0, "high"] == 0.5
    # over both seeds each task gains 0.25 on average: every resample has mean 0.25 (paired, no spread)
    assert g.loc["all", "gain"] == 0.25 and g.loc["all", "low"] == 0.25 and g.loc["all", "high"] == 0.25
    assert g.loc["all", "tries"] == 8 and g.loc["all", "tasks"] == 2


def test_paired_interval_is_narrower_than_the_spread_of_the_tasks():
    # every task gains exactly 1 success in 8 over a very different start: the paired interval is a point
    start = list(range(0, 8)) * 5
    test = _test_table(start, [s + 1 for s in start], tries=9)
    g = train.paired_gains(test).iloc[-1]
    assert abs(g["gain"] - 1 / 9) < 1e-12 and abs(g["low"] - 1 / 9) < 1e-12 and abs(g["high"] - 1 / 9) < 1e-12


def test_async_summary_times_steps_without_the_first_and_pairs_the_test_by_task():
    nan = float("nan")
    curve = pd.DataFrame({
        "config": ["sync"] * 4 + ["async-k1"] * 4, "seed": 0, "step": [0, 1, 2, 3] * 2,
        "reward_mean": [nan, 0.1, 0.2, 0.4, nan, 0.0, 0.1, 0.1],
        # step 1 (the worker's start) and evaluation time are not step time
        "step_s": [nan, 99.0, 10.0, 14.0, nan, 99.0, 6.0, 9.0], "eval_s": [1.0, nan, nan, 2.0, 1.0, nan, nan, 2.0],
        "rollout_s": [nan, 90.0, 6.0, 6.0, nan, 90.0, 0.5, 0.5], "update_s": [nan, 9.0, 4.0, 6.0, nan, 9.0, 5.5, 5.5],
        "rollout_worker_s": [nan] * 4 + [nan, 9.0, 7.0, 7.0], "staleness_mean": [nan] * 4 + [nan, 1.0, 1.0, 0.5]})
    test = pd.DataFrame({"config": ["sync"] * 2 + ["async-k1"] * 2, "seed": 0, "task": [0, 1] * 2,
                         "start_rate": [0.0, 0.5] * 2, "end_rate": [0.5, 0.5, 0.0, 0.0]})
    s = train.async_summary(curve, test).set_index("config")
    assert s.loc["sync", "step_s"] == 11.0 and s.loc["async-k1", "step_s"] == 6.5  # 14 - 2 s of evaluation
    assert s.loc["sync", "step_s_mean"] == 11.0 and s.loc["async-k1", "step_s_mean"] == 6.5
    assert s.loc["async-k1", "wait_s"] == 0.5 and s.loc["async-k1", "worker_s"] == 7.0
    assert s.loc["async-k1", "staleness"] == 0.75 and s.loc["sync", "steps"] == 3
    assert abs(s.loc["sync", "train_first2"] - 0.15) < 1e-12 and abs(s.loc["sync", "train_last2"] - 0.3) < 1e-12
    assert s.loc["sync", "gain"] == 0.25 and s.loc["sync", "low"] == 0.0 and s.loc["sync", "high"] == 0.5
    assert s.loc["async-k1", "gain"] == -0.25 and s.loc["async-k1", "test_end"] == 0.0
    assert train.async_summary(curve)["gain"].isna().all()


def test_gain_difference_between_attentions_is_paired_by_task():
    a = _test_table([0, 0, 4], [2, 2, 4], attention="sinkflex")
    b = _test_table([1, 1, 4], [1, 1, 4], attention="sdpa")
    d = train.gain_difference(pd.concat([a, b]), "sinkflex", "sdpa")
    assert abs(d["difference"] - (0.5 + 0.5 + 0) / 3) < 1e-12 and d["tasks"] == 3
    assert 0 <= d["low"] <= d["difference"] <= d["high"] <= 0.5
    with pytest.raises(ValueError, match="no rows with attention 'eager'"):
        train.gain_difference(a, "sinkflex", "eager")
