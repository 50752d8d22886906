"""Rollouts that overlap training (train.async_rollouts), with a real worker process: with no overlap
allowed (k = 0) it trains exactly what the single-process trainer trains; groups older than k are
dropped and resampled; a run killed with SIGKILL resumes with a fresh worker that refills the queue from
the checkpoint, so no group is trained twice; under torchrun rank 0's worker feeds both ranks the same
number of groups per step, through a resume; and what it cannot run is refused with a clear error."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from interrupted_trainer import run_script

from sinkflex_core import train
from sinkflex_core.train import ConfigError, TaskSampler, TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]

# As tests/test_train_loop.py's TINY: rewards are 0 for a random policy, the entropy bonus and the KL
# term give every step a loss and a gradient to compare.
TINY = dict(hidden_size=64, num_layers=2, tasks_per_step=2, group_size=2, num_minibatches=2, micro_batch_size=2,
            ppo_epochs=2, max_total_tokens=320, max_new_tokens_per_turn=12, max_turns=3, system_prompt="x",
            include_tools=False, eval_tasks=1, eval_samples=2, kl_coef=0.04, entropy_coef=0.01, lr=1e-3,
            threads=1, progress=False, tensorboard=False, save_every=1, eval_every=0)


def _cfg(tokenizer_dir: str, out: Path, **kw) -> TrainConfig:
    return TrainConfig.from_dict({**TINY, "tokenizer": tokenizer_dir, "out_dir": str(out), **kw})


def _groups(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollout_groups.jsonl").read_text().splitlines()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a dead child of this process stays a zombie until reaped
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "Z"
    return state != "Z"


def _tasks_in_order(cfg: TrainConfig, steps: int) -> list[list[int]]:
    """The tasks of the first ``steps`` steps, as the synchronous trainer draws them (all train tasks)."""
    sampler = TaskSampler(train.count_tasks(cfg.env_id, cfg.train_split), cfg.tasks_per_step, cfg.seed)
    return [sampler.next_batch() for _ in range(steps)]


@pytest.mark.slow
def test_no_overlap_through_the_worker_is_the_synchronous_run(tokenizer_dir, tmp_path):
    """k = 0: every step waits for rollouts sampled with the newest weights, as the single-process trainer
    does, so the worker must give the same samples and the run the same metrics and weights, bit for bit.
    The synchronous default starts no process at all."""
    sync = Trainer(_cfg(tokenizer_dir, tmp_path / "sync", steps=2))
    assert sync.async_rollouts is None
    sync.run()
    assert not multiprocessing.active_children() and not (tmp_path / "sync" / "rollout_groups.jsonl").exists()

    worker = Trainer(_cfg(tokenizer_dir, tmp_path / "k0", steps=2, async_rollouts=True, max_staleness=0))
    worker.run()
    assert worker.async_rollouts.proc is None and not multiprocessing.active_children()  # stopped at the end

    a, b = pd.read_csv(tmp_path / "sync" / "metrics.csv"), pd.read_csv(tmp_path / "k0" / "metrics.csv")
    compared = ["reward_mean", "loss", "pg_loss", "kl", "entropy", "ratio_mean", "ratio_max", "grad_norm",
                "tokens_policy", "tokens_total", "turns_mean", "eval_reward"]
    pd.testing.assert_frame_equal(a[compared], b[compared], check_exact=True)
    assert (b["tokens_policy"].iloc[1:] > 0).all() and b["loss"].iloc[1:].abs().gt(0).all()
    assert b["staleness_max"].iloc[1:].tolist() == [0, 0] and b["groups_dropped"].iloc[1:].tolist() == [0, 0]
    assert a["staleness_max"].isna().all()  # the synchronous run has no such column filled
    ours = dict(worker.policy.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in sync.policy.named_parameters())
    groups = _groups(tmp_path / "k0")
    assert [g["tasks"] for g in groups] == _tasks_in_order(sync.cfg, 2)
    assert [g["versions"] for g in groups] == [[0], [1]] and [g["trained_at"] for g in groups] == [0, 1]

    # The timelines (train.step_timeline). Synchronous: rollout then update, step after step, no worker.
    tl = train.step_timeline(tmp_path / "sync")
    steps = tl[tl["activity"] != "evaluation"]
    assert set(tl["lane"]) == {"learner"} and steps["activity"].tolist() == ["rollout", "update"] * 2
    assert (steps["start"].diff().iloc[1:] > 0).all() and (steps["start"].iloc[1:].to_numpy()
                                                           >= steps["end"].iloc[:-1].to_numpy() - 1e-6).all()
    # k = 0 through the worker: step s is sampled after update s - 1 (whose weights it needs) and before
    # update s (which trains on it); the worker's spans are put on the learner's clock, so both checks
    # read one clock (50 ms for reading it in two processes).
    tl = train.step_timeline(tmp_path / "k0")
    work = tl[tl["lane"] == "worker"].set_index("step")
    update = tl[(tl["lane"] == "learner") & (tl["activity"] == "update")].set_index("step")
    assert work.index.tolist() == [1, 2] and (work["end"] > work["start"]).all()
    assert (work["end"] <= update.loc[[1, 2], "start"] + 0.05).all()
    assert work.loc[2, "start"] >= update.loc[1, "end"] - 0.05


@pytest.mark.slow
def test_groups_older_than_k_are_dropped_and_resampled(tokenizer_dir, tmp_path):
    """Step 1's groups arrive sampled with version 0; the learner then announces version 3 (as if three
    updates had happened meanwhile), so with k = 1 they are 3 versions old: dropped, counted, and the same
    tasks sampled again with the newest weights."""
    trainer = Trainer(_cfg(tokenizer_dir, tmp_path / "run", steps=2, async_rollouts=True, max_staleness=1,
                           old_logprobs="recompute", tis_cap=2.0))
    ar = trainer.async_rollouts
    try:
        ar.start()
        while set(ar.ready[1]["calls"]) != ar.ready[1]["expect"]:
            ar._receive()
        assert [c[0] for c in ar.ready[1]["calls"].values()] == [0]
        ar.publish(3)
        row = trainer.step()
    finally:
        ar.close()
    assert row["groups_dropped"] == 2 and row["staleness_max"] == 0  # both groups of the step, then fresh ones
    (entry,) = _groups(tmp_path / "run")
    assert entry["versions"] == [3] and entry["groups_dropped"] == 2
    assert entry["tasks"] == _tasks_in_order(trainer.cfg, 1)[0]
    assert 0 <= row["tis_clip_frac"] <= 1 and row["tis_weight_mean"] > 0 and row["logp_gap_rollout"] is not None
    assert not _alive(entry["worker_pid"])


@pytest.mark.slow
def test_a_run_killed_mid_update_resumes_with_a_fresh_worker_and_trains_no_group_twice(tokenizer_dir, tmp_path):
    """k = 1: step 2 was sampled with version 0 while step 1 updated. SIGKILL in step 2's update: the
    checkpoint is step 1's. The restarted run's worker starts from step 1's weights and samples step 2
    again (version 1, not the killed run's 0); each step's tasks are the sampler's, each trained once,
    and the killed run's worker has gone by itself."""
    out = tmp_path / "cut"
    config = tmp_path / "cut.json"
    config.write_text(json.dumps(_cfg(tokenizer_dir, out, steps=2, async_rollouts=True, max_staleness=1).to_dict()))
    proc = run_script([config, "update", 2])
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert train.latest_checkpoint(out / "checkpoints").name == "step_00000001"
    killed = _groups(out)
    assert [g["step"] for g in killed] == [1, 2]  # step 2 was logged, then killed in its update
    deadline = time.monotonic() + 20
    while _alive(killed[0]["worker_pid"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(killed[0]["worker_pid"]), "the worker outlived its killed learner"

    done = run_script([config])
    assert done.returncode == 0, done.stderr[-3000:]
    groups = _groups(out)
    assert [g["step"] for g in groups] == [1, 2]
    assert groups[0] == killed[0] and {g["worker_pid"] for g in groups[1:]} != {killed[0]["worker_pid"]}
    assert [g["tasks"] for g in groups] == _tasks_in_order(_cfg(tokenizer_dir, out), 2)
    # refilled from the checkpoint: step 2 is sampled with step 1's weights, not the killed run's version 0
    assert killed[1]["versions"] == [0] and groups[1]["versions"] == [1] and groups[1]["trained_at"] == 1
    payload, _ = train.load_checkpoint(train.latest_checkpoint(out / "checkpoints"))
    assert payload["trainer"]["step"] == 2
    assert payload["trainer"]["sampler"] == {"epoch": 0, "cursor": 4, "num_tasks": len(payload["trainer"]
                                             ["train_task_ids"]), "seed": 0}
    df = pd.read_csv(out / "metrics.csv")
    assert df["step"].tolist() == [0, 1, 2] and df["staleness_max"].iloc[1:].tolist() == [0, 0]


@pytest.mark.slow
def test_a_worker_whose_learner_died_samples_no_queued_step_and_exits(tokenizer_dir, tmp_path):
    """The learner died (SIGKILL) with three steps queued for the worker. The worker must not sample them
    for nobody, and must exit although nobody reads its results: it holds the results pipe's read end
    too, so a write into a full pipe never fails, it blocks, and with it the exit (the queue's feeder
    thread is joined at exit). The worker is given a learner pid that is not its parent's, which is what
    it sees once its learner is gone."""
    import torch.multiprocessing as mp

    from sinkflex_core.train.async_rollouts import rollout_worker

    cfg = _cfg(tokenizer_dir, tmp_path / "run", group_size=4, max_turns=1, max_new_tokens_per_turn=400,
               max_total_tokens=2048)  # ~70 kB of results a step: more than a pipe holds
    ctx = mp.get_context("spawn")
    requests, weights, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    weights.put(("weights", 0, {}))
    for step in (1, 2, 3):
        requests.put(("rollout", step, [0, 1], 0, [(0, 2)]))
    proc = ctx.Process(target=rollout_worker, args=(cfg.to_dict(), -1, requests, weights, results), daemon=True)
    proc.start()
    try:
        proc.join(timeout=90)
        assert proc.exitcode == 0, "the worker of a dead learner did not exit"
        assert results.qsize() == 0  # no step sampled for a learner that is gone
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        for q in (requests, weights, results):
            q.cancel_join_thread()
            q.close()


@pytest.mark.slow
def test_torchrun_two_ranks_share_one_worker_and_resume(tokenizer_dir, tmp_path):
    """`torchrun --nproc_per_node 2` (gloo, FSDP2), k = 1: rank 0's worker samples every step and rank 0
    hands each rank the groups of its share of the step's tasks. Two steps, the first by one trainer
    (its worker has step 2 in flight when it stops), the second by a second one that resumes from the checkpoint with a fresh worker (in the same
    processes: tests/async_dist_trainer.py). Every rank trains one group per step, the ones of the tasks
    the synchronous trainer would give it; no step is trained twice; staleness stays within k; the
    resumed step is sampled with the checkpoint's weights; both ranks end with the same weights."""
    out = tmp_path / "dist"
    cfg = _cfg(tokenizer_dir, out, steps=2, async_rollouts=True, max_staleness=1, old_logprobs="recompute",
               tis_cap=2.0, ppo_epochs=1, max_turns=2, max_new_tokens_per_turn=8)
    config = tmp_path / "dist.json"
    config.write_text(json.dumps(cfg.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).with_name("async_dist_trainer.py")), str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    order = _tasks_in_order(cfg, 2)
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for r, mine in enumerate(ranks):
        assert [s["step"] for s in mine["steps"]] == [1, 2] and [s["run"] for s in mine["steps"]] == [1, 2]
        assert [s["groups"] for s in mine["steps"]] == [1, 1]
        assert [s["tasks"] for s in mine["steps"]] == [[tasks[r]] for tasks in order]
    assert ranks[0]["weights"] == ranks[1]["weights"]

    groups = _groups(out)
    assert [g["step"] for g in groups] == [1, 2] and [g["tasks"] for g in groups] == order
    assert all(g["rank_groups"] == [1, 1] and g["groups_dropped"] == 0 for g in groups)
    assert [g["trained_at"] for g in groups] == [0, 1]
    assert all(0 <= g["trained_at"] - v <= 1 for g in groups for v in g["versions"])
    # the resumed trainer's worker is a new process, and it starts from the checkpoint's weights (one
    # rollout call per rank's share)
    assert groups[1]["worker_pid"] != groups[0]["worker_pid"] and groups[1]["versions"] == [1, 1]
    df = pd.read_csv(out / "metrics.csv")
    assert df["step"].tolist() == [0, 1, 2] and (df["trajectories"].iloc[1:] == 4).all()
    assert (df["staleness_max"].iloc[1:] <= 1).all() and (df["groups_dropped"].iloc[1:] == 0).all()
    assert df["loss"].iloc[1:].abs().gt(0).all() and df["tis_clip_frac"].iloc[1:].between(0, 1).all()
    assert (out / "policy" / "model.safetensors").is_file()


@pytest.mark.slow
def test_no_progress_bars_from_the_worker_without_progress(tmp_path):
    """`sinkflex train --set progress=false` (a log file's output): the command line turns transformers'
    bars off, and the rollout worker, a process of its own, must not draw its "Loading weights" bar."""
    cmd = [sys.executable, "-m", "sinkflex_core.train", "--model", str(ROOT / "data" / "retail-tiny-start"),
           "--async-rollouts", "--out-dir", str(tmp_path / "run"), "--no-resume"]
    for kv in ("steps=1", "tasks_per_step=1", "group_size=2", "eval_tasks=1", "eval_samples=1", "max_total_tokens=512",
               "max_new_tokens_per_turn=16", "max_turns=2", "threads=1", "save_every=0", "tensorboard=false",
               "progress=false", "max_minutes=0"):
        cmd += ["--set", kv]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1/1" in proc.stdout and "it/s]" not in proc.stderr, proc.stderr[-2000:]


def test_what_async_rollouts_cannot_run_is_refused(tokenizer_dir, tmp_path):
    cfg, _ = train.config_from_argv(["--async-rollouts", "--max-staleness", "2", "--out-dir", str(tmp_path)])
    assert cfg.async_rollouts and cfg.max_staleness == 2
    with pytest.raises(ConfigError, match="old_logprobs=recompute"):
        _cfg(tokenizer_dir, tmp_path / "t", tis_cap=2.0)
    with pytest.raises(ConfigError, match="max_staleness"):
        _cfg(tokenizer_dir, tmp_path / "m", async_rollouts=True, max_staleness=-1)
    # GPU ids are text as given, never a number: "7" and "0,1" reach CUDA_VISIBLE_DEVICES unchanged
    cfg, _ = train.config_from_argv(["--async-rollouts", "--set", "rollout_worker_gpus=7", "--out-dir", str(tmp_path)])
    assert cfg.rollout_worker_gpus == "7"


def _wait_for_queued_results(ar, n: int) -> None:
    """Until the worker has put ``n`` results on the queue (none of them read yet)."""
    deadline = time.monotonic() + 120
    while ar.results.qsize() < n:
        assert time.monotonic() < deadline, "the worker put no results in 120 s"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_worker_that_fails_after_putting_groups_reports_its_own_error(tokenizer_dir, tmp_path):
    """k = 1: the worker samples steps 1 and 2, then fails (here: weights its model does not have) and
    exits. The groups it put before failing are still read and trained on, and the next step stops with
    the worker's own error message, not an error from reading the queue of a process that has gone."""
    trainer = Trainer(_cfg(tokenizer_dir, tmp_path / "run", steps=3, async_rollouts=True, max_staleness=1,
                           save_every=0))
    ar = trainer.async_rollouts
    try:
        ar.start()  # version 0 sent; steps 1 and 2 requested
        _wait_for_queued_results(ar, 2)
        ar.weights.put(("weights", 1, {"no_such_parameter": torch.zeros(1)}))
        ar.requests.put(("rollout", 99, [0], 1, [(0, 1)]))
        ar.proc.join(timeout=60)
        assert ar.proc.exitcode == 0  # it stopped by itself, after putting its error
        assert [trainer.step()["step"] for _ in range(2)] == [1, 2]
        with pytest.raises(RuntimeError, match="(?s)the rollout worker failed.*no_such_parameter"):
            trainer.step()
    finally:
        ar.close()


@pytest.mark.slow
def test_a_worker_killed_after_putting_groups_is_reported_as_dead(tokenizer_dir, tmp_path):
    """The worker is SIGKILLed (as by the OOM killer) after putting steps 1 and 2: those still train, and
    step 3 stops with "the rollout worker died", not a ConnectionRefusedError from reading the queue."""
    trainer = Trainer(_cfg(tokenizer_dir, tmp_path / "run", steps=3, async_rollouts=True, max_staleness=1,
                           save_every=0))
    ar = trainer.async_rollouts
    try:
        ar.start()
        _wait_for_queued_results(ar, 2)
        os.kill(ar.proc.pid, signal.SIGKILL)
        ar.proc.join(timeout=30)
        assert [trainer.step()["step"] for _ in range(2)] == [1, 2]
        with pytest.raises(RuntimeError, match=r"the rollout worker died \(exit code -9\)"):
            trainer.step()
    finally:
        ar.close()


def test_an_error_still_in_the_pipe_when_the_worker_has_exited_is_reported():
    """The worker puts its error and exits; the learner's wait can time out just before the message
    reaches its end of the pipe (the queue's feeder thread writes it a moment later). The learner must
    then report the worker's own error, not a bare "died (exit code 0)"."""
    from sinkflex_core.train.async_rollouts import AsyncRollouts

    class LateQueue:  # the first read finds the pipe still empty, as in that moment
        def __init__(self):
            self.reads = 0

        def get(self, timeout=None):
            self.reads += 1
            if self.reads == 1:
                import queue

                raise queue.Empty
            return ("error", "Traceback ...\nValueError: the worker's own error")

    exited = multiprocessing.get_context("spawn").Process(target=int)
    exited.start()
    exited.join()
    ar = object.__new__(AsyncRollouts)
    ar.results, ar.proc = LateQueue(), exited
    with pytest.raises(RuntimeError, match="(?s)the rollout worker failed.*the worker's own error"):
        ar._receive()
