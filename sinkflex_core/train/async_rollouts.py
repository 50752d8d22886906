"""Rollouts that overlap training: a worker process samples the next steps' groups while the learner
updates on the current one (``TrainConfig.async_rollouts``).

The learner (:class:`sinkflex_core.train.Trainer`) and the worker talk through three queues::

    learner --requests--> worker    ("rollout", step, tasks, min_version, calls): play these tasks
    learner --weights---> worker    ("weights", version, state): the policy after `version` updates
    worker  --results---> learner   ("batch", step, version, offset, batches, seconds, started, backend)
                                    or ("error", text)

(``started``: the wall-clock time, ``time.time()``, at which the worker began the call: the learner
puts it on its own clock for the timeline that ``rollout_groups.jsonl`` records.)

- **Tasks** come from the learner's :class:`TaskSampler`: a look-ahead copy draws the tasks of the steps
  submitted in advance, and the learner's own sampler advances only when a step is *trained*, so the
  checkpoint's sampler state is the record of what was consumed. A resumed run starts a fresh worker
  (whatever was in flight is dropped with the old process) and resubmits from that state: the task
  order is the synchronous run's, and no group is trained twice.
- **Versions**: version v is the policy after v updates (= the step index; resumable). Step ``s`` is
  trained at version ``s - 1`` and submitted once the learner reaches version ``s - 1 - k``
  (``k = max_staleness``), with that version as its ``min_version``: before each rollout call the worker
  takes the newest weights it has been sent, never older than ``min_version``. So a group is at most
  ``k`` updates old when it is trained; one that is older anyway (the check runs on every group) is
  dropped, counted, and its tasks resampled with the newest weights. ``k = 0`` is the synchronous
  schedule run through the worker: the same samples as the single-process trainer.
- **Weights**: after every update the learner sends the trainable parameters (full fine-tuning) or the
  LoRA adapters merged into the base weights (the worker holds a plain model), cloned, so the worker never
  sees a half-updated tensor. With ``rollout_backend="vllm"`` the worker samples with a vLLM engine and
  loads each version into it in place (:meth:`sinkflex_core.rollout.VLLMBackend.update_weights`, as
  the synchronous trainer does); ``rollout_worker_gpus`` puts it on GPUs of its own. Otherwise it
  runs :class:`sinkflex_core.rollout.HFBackend` on the CPU.
- **Sampling seeds** are the synchronous trainer's (a function of the run seed and the step), so what a
  group samples depends only on its tasks, its step and the weights it was sampled with.

Under torchrun (N ranks) there is still one worker, started by rank 0, and only rank 0 talks to it:

- The worker plays a step's tasks in calls that follow the ranks' shares (:func:`call_bounds`: rank
  ``r`` gets tasks ``r * n / N`` to ``(r + 1) * n / N``, cut into ``rollout_tasks_per_call`` as the
  synchronous trainer's ranks cut theirs), so each call's groups belong to one rank whole.
- Rank 0 waits for the step, applies the staleness check to all its groups (a drop resamples the whole
  step for every rank), and hands each rank its share with one ``scatter_object_list``, together with
  the step's tasks and metrics. Every rank thus trains on the same number of groups per step (the
  data-parallel update stays in lockstep), checks the tasks against its own sampler (all ranks hold
  the same one) and logs the same staleness figures.
- After each update every rank refreshes the trainer's unsharded rollout copy from the FSDP shards (the
  all-gather the evaluations and the exported policy already rely on); rank 0 sends the worker its
  trainable weights from that copy, so publishing adds no collective.
- Resume: every rank loads the checkpoint's sampler state; rank 0 starts a fresh worker and refills the
  queue from it, exactly as with one process.

Why one worker rather than one per rank: the decision which groups form a step, and which are too old,
is taken in one place, so the ranks cannot disagree about it and need no extra agreement round; the
weights are sent once per update instead of N times; on CPU it costs one extra process rather than N;
and on GPUs a generation engine serves a whole step best as one large batch, on devices of its own.
The price is that the step's groups (token ids, masks and log-probs, small beside an update) pass
through rank 0 on their way to the other ranks.

Each trained step appends one line to ``out_dir/rollout_groups.jsonl`` (step, tasks, versions,
staleness, dropped groups, groups per rank, the worker's backend, ``HFBackend`` or ``VLLMBackend``, and
``worker_spans``: when each of the step's rollout calls ran in the worker, as ``[start, end]`` on the
learner's ``elapsed_s`` clock); a resumed run cuts it back to the checkpoint's step, like ``metrics.csv``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import queue
import time
import traceback
from pathlib import Path

import torch

from ..paths import write_text_atomic
from .config import TrainConfig, vllm_backend

_POLL_S = 1.0  # how often a waiting worker checks that its learner is still alive
_WAIT_S = 1800.0  # most seconds the learner waits for one result (a stuck worker ends the run)


def rollout_worker(cfg_dict: dict, parent_pid: int, requests, weights, results) -> None:
    """The worker process: a plain copy of the policy, sampled with :class:`HFBackend` or, with
    ``rollout_backend="vllm"``, with a :class:`VLLMBackend` engine that every weight update reaches
    in place; serves ``requests``.

    Exits on ``("stop",)``, or by itself once its learner has died (a SIGKILLed learner cannot tell it):
    within a second or so when idle, else when the rollout call it is running ends (the steps queued
    after it are not sampled)."""
    backend = None
    try:
        cfg = TrainConfig.from_dict(cfg_dict)
        if not cfg.progress:  # as the command line does in the learner: a spawned process starts with the bars on
            from .. import models

            models.hide_loading_bars()
        if cfg.rollout_worker_gpus:  # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = cfg.rollout_worker_gpus
        from .. import rollout
        from .data import derive_seed
        from .policy import causal_lm, load_model, load_tokenizer

        torch.set_num_threads(cfg.threads or 1)
        tokenizer = load_tokenizer(cfg)
        # LoRA runs send merged weights: the worker's model has no adapters.
        model = load_model(dataclasses.replace(cfg, lora=False), tokenizer, torch.device("cpu")).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        vllm = cfg.rollout_backend == "vllm"
        if vllm:
            backend = vllm_backend(cfg, causal_lm(model), tokenizer)
        else:
            backend = rollout.HFBackend(model, tokenizer)
        params = dict(model.named_parameters())
        version = -1

        def orphaned() -> bool:
            """Whether the learner has died (this process then belongs to another parent)."""
            return os.getppid() != parent_pid

        def load(state: dict) -> None:
            unknown = sorted(set(state) - set(params))
            if unknown:
                raise RuntimeError(f"the learner sent weights the worker's model does not have: {unknown[:5]}")
            with torch.no_grad():
                for name, value in state.items():
                    params[name].copy_(value)
            if vllm:  # the engine holds its own copy: the new weights go into it in place
                backend.update_weights(causal_lm(model))

        def newest(min_version: int) -> int:
            """Take the newest weights sent so far, waiting for ``min_version`` if it has not come yet."""
            got = version
            while True:
                try:
                    msg = weights.get(timeout=_POLL_S) if got < min_version else weights.get_nowait()
                except queue.Empty:
                    if got >= min_version:
                        return got
                    if orphaned():
                        raise SystemExit(0) from None
                    continue
                load(msg[2])
                got = msg[1]

        while True:
            try:
                msg = requests.get(timeout=_POLL_S)
            except queue.Empty:
                if orphaned():
                    return
                continue
            if msg[0] == "stop":
                return
            _, step, tasks, min_version, calls = msg
            seed = derive_seed(cfg.seed, "train", step) & 0x7FFFFFFF
            for i, j in calls:
                if orphaned():  # a dead learner's queued steps: nobody would train them
                    return
                version = newest(min_version)
                t0, started = time.perf_counter(), time.time()
                torch.manual_seed(seed)
                rcfg = rollout_config_of(cfg, seed)
                batch = rollout.collect_rollouts(backend, tokenizer, cfg.env_id, tasks[i:j], cfg.train_split, rcfg)
                # By value, not as torch's shared-memory handles: those are served by this process and
                # die with it, so groups it put before failing (or being killed) could not be read, and
                # the learner would fail on them instead of reporting this worker's error.
                results.put(("batch", step, version, i, pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL),
                             time.perf_counter() - t0, started, type(backend).__name__))
    except SystemExit:
        return
    except BaseException:
        results.put(("error", traceback.format_exc()))
    finally:
        if os.getppid() != parent_pid:
            # Nobody reads the results any more: exit without waiting for the queue's feeder thread,
            # which blocks for good once the pipe is full (this process holds its read end too).
            results.cancel_join_thread()
        close = getattr(backend, "close", None)
        if close is not None:  # vLLM: its engine's processes end with it
            close()


def rollout_config_of(cfg: TrainConfig, seed: int):
    """The training rollouts' settings, as the synchronous trainer's ``_collect`` builds them."""
    from .config import rollout_config

    return rollout_config(cfg, seed, cfg.group_size, cfg.temperature)


def call_bounds(n_tasks: int, world: int, per_call: int) -> list[tuple[int, int]]:
    """The rollout calls of one step of ``n_tasks`` tasks, as ``(start, end)`` slices of its task list:
    rank ``r``'s share (``n_tasks / world`` tasks from ``r * n_tasks / world``) cut into calls of
    ``per_call`` tasks (0: the whole share), as the synchronous trainer's ranks cut theirs. No call spans
    two shares, so every call's groups go to one rank whole."""
    share = n_tasks // world
    per_call = per_call or max(1, share)
    return [(r * share + i, r * share + min(share, i + per_call)) for r in range(world)
            for i in range(0, share, per_call)]


class AsyncRollouts:
    """The learner's side of the worker (see the module docstring). ``next_rows(step)`` returns this
    rank's share of the step's batch as :func:`data.concat_rollouts` rows, ``publish()`` sends the
    weights after an update, ``close()`` stops the worker. ``start()`` (the first ``next_rows`` calls it
    if the trainer has not) runs after any resume. Under torchrun only rank 0 has a worker; every rank
    calls the same methods in the same order (``next_rows`` is a collective)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg
        self.dist = trainer.dist
        self.k = self.cfg.max_staleness
        self.proc = None
        self.started = False
        self.version = 0
        self.log_path = Path(self.cfg.out_dir) / "rollout_groups.jsonl"
        self.last: dict = {}
        self.backend_name: str | None = None

    # -- process ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Rank 0: start the worker, send it the current weights and the first steps' tasks (after any
        resume). The other ranks have nothing to start: they get their groups from rank 0."""
        import torch.multiprocessing as mp

        if self.started:
            return
        self.started = True
        tr = self.trainer
        self.version = tr.step_idx
        if not self.dist.main:
            return
        ctx = mp.get_context("spawn")
        self.requests, self.weights, self.results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        # a daemonic process may not start processes of its own, as vLLM's engine does; the worker
        # ends with its learner anyway (close(), or its check on the learner's pid)
        self.proc = ctx.Process(target=rollout_worker, name="sinkflex-rollout-worker",
                                daemon=self.cfg.rollout_backend != "vllm",
                                args=(self.cfg.to_dict(), os.getpid(), self.requests, self.weights, self.results))
        self.proc.start()
        self.ahead = copy.deepcopy(tr.sampler)  # draws the tasks of the steps submitted in advance
        self.submitted: dict[int, list[int]] = {}
        self.next_submit = tr.step_idx + 1
        self.ready: dict[int, dict] = {}
        self._cut_log(tr.step_idx)
        self.publish()

    def close(self) -> None:
        self.started = False
        if self.proc is None:
            return
        if self.proc.is_alive():
            # What the worker is sampling now would be thrown away: a short wait for a clean exit, then
            # SIGTERM (a run that stops early need not wait for a rollout of a step it will not train).
            self.requests.put(("stop",))
            self.proc.join(timeout=2)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=10)
        for q in (self.requests, self.weights, self.results):
            q.cancel_join_thread()
            q.close()
        self.proc = None

    # -- weights and requests -----------------------------------------------------------------------
    @torch.no_grad()
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What the worker needs after an update, as fresh CPU tensors: the trainable parameters, or
        under LoRA the whole merged model (names as in the plain causal LM). Under FSDP they are read from
        the trainer's unsharded rollout copy, which every rank has just refreshed from the shards (the
        all-gather that the evaluations need anyway), so rank 0 sends them without another collective."""
        from .policy import causal_lm

        tr = self.trainer
        lm = tr.rollout_lm if tr.rollout_lm is not None else tr.policy.lm
        if self.cfg.lora:
            merged = causal_lm(copy.deepcopy(lm).merge_and_unload())
            return {n: p.detach().cpu().clone() for n, p in merged.named_parameters()}
        return {n: p.detach().cpu().clone() for n, p in lm.named_parameters() if p.requires_grad}

    def publish(self, version: int | None = None) -> None:
        """Send the weights as ``version`` (default: the learner's, its step index), then submit the
        steps that this version lets start (up to ``version + k + 1``). Rank 0 only does the sending."""
        if not self.started:
            return
        self.version = self.trainer.step_idx if version is None else version
        if self.proc is None:
            return
        self.weights.put(("weights", self.version, self.trainable_state()))
        last = min(self.trainer.total_steps, self.version + self.k + 1)
        while self.next_submit <= last:
            tasks = [self.trainer.train_task_ids[i] for i in self.ahead.next_batch()]
            self.submitted[self.next_submit] = tasks
            self._request(self.next_submit, tasks)
            self.next_submit += 1

    def _request(self, step: int, tasks: list[int]) -> None:
        calls = call_bounds(len(tasks), self.dist.world, self.cfg.rollout_tasks_per_call)
        self.requests.put(("rollout", step, tasks, self.version, calls))
        self.ready[step] = {"calls": {}, "expect": {i for i, _ in calls}}

    # -- consuming ----------------------------------------------------------------------------------
    def _receive(self) -> None:
        deadline = time.monotonic() + _WAIT_S
        while True:
            try:
                msg = self.results.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    try:  # what it sent just before it exited (its error) may still be in the pipe
                        msg = self.results.get(timeout=_POLL_S)
                        break
                    except queue.Empty:
                        raise RuntimeError(f"the rollout worker died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no rollouts from the worker in {_WAIT_S:.0f} s") from None
        if msg[0] == "error":
            raise RuntimeError("the rollout worker failed:\n" + msg[1])
        _, step, version, offset, batch, seconds, started, self.backend_name = msg
        batch = pickle.loads(batch)
        # the call's start on the learner's clock (elapsed_s): both processes read the same wall clock
        begin = self.trainer.elapsed() - (time.time() - started)
        self.ready[step]["calls"][offset] = (version, batch, seconds, begin)

    def _take_step(self, step: int) -> list[tuple[list[int], list, dict]]:
        """Rank 0: wait for step ``step``'s groups (dropping and resampling any older than ``k``), log
        the step, and split it by rank: ``[(tasks, batches, metrics)]``, one entry per rank, the tasks
        being the whole step's (every rank checks them against its own sampler)."""
        dropped, seconds = 0, 0.0
        while True:
            slot = self.ready[step]
            while set(slot["calls"]) != slot["expect"]:
                self._receive()
            offsets = sorted(slot["calls"])
            calls = [slot["calls"][o] for o in offsets]
            stale = [c for c in calls if self.version - c[0] > self.k]
            seconds += sum(c[2] for c in calls)
            if not stale:
                break
            # Older than k (not reachable through publish()'s schedule, but checked on every group):
            # dropped, and the same tasks resampled with the newest weights.
            dropped += sum(len(c[1]) // self.cfg.group_size for c in stale)
            self._request(step, self.submitted[step])
        tasks = self.submitted.pop(step)
        del self.ready[step]
        groups = [(self.version - c[0], len(c[1]) // self.cfg.group_size) for c in calls]
        n = sum(g for _, g in groups)
        last = {"staleness_mean": sum(s * g for s, g in groups) / max(1, n),
                "staleness_max": max(s for s, _ in groups), "groups_dropped": dropped, "rollout_worker_s": seconds}
        share = len(tasks) // self.dist.world
        rank_of = [o // share for o in offsets]  # call_bounds: no call spans two ranks' shares
        per_rank = [[c[1] for c, r in zip(calls, rank_of) if r == rank] for rank in range(self.dist.world)]
        self._log({"step": step, "tasks": tasks, "versions": [c[0] for c in calls], "trained_at": self.version,
                   "groups_dropped": dropped, "worker_pid": self.proc.pid,
                   "worker_spans": [[round(c[3], 3), round(c[3] + c[2], 3)] for c in calls],
                   "worker_backend": self.backend_name,
                   "rank_groups": [sum(len(b) // self.cfg.group_size for b in bs) for bs in per_rank]})
        return [(tasks, bs, last) for bs in per_rank]

    def next_rows(self, step: int) -> dict:
        """This rank's share of step ``step``'s rows (as ``Trainer._collect_step`` returns them), from
        groups at most ``k`` versions old; also advances the learner's sampler past the step's tasks.

        Rank 0 decides which groups form the step (so staleness and drops are counted once) and scatters
        them: rank ``r`` gets the groups of the tasks the synchronous trainer would give it, the same
        number on every rank, so the data-parallel update stays in lockstep."""
        from .data import concat_rollouts

        tr = self.trainer
        if not self.started:
            self.start()
        parts = self._take_step(step) if self.dist.main else None
        if self.dist.enabled:
            mine = [None]
            torch.distributed.scatter_object_list(mine, parts, src=0)
            tasks, batches, self.last = mine[0]
        else:
            tasks, batches, self.last = parts[0]
        expected = [tr.train_task_ids[i] for i in tr.sampler.next_batch()]
        if expected != tasks:
            raise RuntimeError(f"step {step}: the worker's tasks {tasks} are not the sampler's {expected}")
        rows = concat_rollouts(batches, pad_id=tr.tokenizer.pad_token_id or 0)
        rows["loss_mask"] = rows["loss_mask"].float()
        return rows

    # -- the groups log -----------------------------------------------------------------------------
    def _log(self, entry: dict) -> None:
        if self.dist.main:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def _cut_log(self, step: int) -> None:
        """Keep the entries of steps <= ``step`` (those the checkpoint has trained on)."""
        if not self.log_path.exists():
            return
        keep = [line for line in self.log_path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        write_text_atomic(self.log_path, "".join(line + "\n" for line in keep))


def step_metrics(trainer, acc: dict) -> dict:
    """The step's extra columns: staleness of the groups trained on (async) and the share of policy
    tokens whose behaviour weight was truncated (``tis_cap``), summed over ranks."""
    out: dict = {}
    ar = getattr(trainer, "async_rollouts", None)
    if ar is not None:
        out.update(ar.last)
    if trainer.cfg.tis_cap > 0:
        s = trainer.dist.reduce({"clip": acc.get("tis_clip_tok", 0.0), "w": acc.get("tis_weight_tok", 0.0),
                                 "tokens": acc["tokens"]})
        if s["tokens"]:
            out.update(tis_clip_frac=s["clip"] / s["tokens"], tis_weight_mean=s["w"] / s["tokens"])
    return out
