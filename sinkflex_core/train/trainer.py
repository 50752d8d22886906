"""The GRPO trainer: one loop from tasks to an updated policy, on one CPU or on N GPUs with FSDP2.

One step (:meth:`Trainer.step`) reads as the algorithm::

    collect      tasks (TaskSampler; task_screen: only those a screening run of the start solved
                 sometimes, evaluate.screened_tasks) -> G rollouts per task (rollout.collect_rollouts,
                 HF or vLLM backend)
    advantages   rewards -> group advantages (grpo.group_advantages); drop_uniform_groups: only the
                 groups whose rewards differ are updated on; reference (and recomputed old) log-probs
    update       update.grpo_update: ppo_epochs x num_minibatches optimizer steps, clipped ratio against
                 the sampling log-probs, KL to the reference, gradient clipping, micro-batches
    metrics      one dict, summed over ranks by Dist.reduce

and :meth:`Trainer.run` adds the evaluations (every ``eval_every`` steps: held-out tasks, mean reward
and pass^k), the atomic checkpoints (every ``save_every`` steps) and, at the end, the policy as a
Hugging Face folder, ``out_dir/policy``.

With ``async_rollouts`` the collect phase reads groups that a worker process sampled while the
previous updates ran (:mod:`sinkflex_core.train.async_rollouts`); under torchrun rank 0 holds the
worker and hands every rank its share of each step.

Distributed: the trained model is wrapped with FSDP2 (``fully_shard`` on every decoder layer and the
root). Every rank samples the rollouts of its own share of the tasks with an unsharded copy of the
policy (the role vLLM plays on GPUs), refreshed from the sharded weights after every update. Losses are
normalised by global token counts so that 1 and N processes compute the same update.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .. import grpo, models
from .async_rollouts import AsyncRollouts
from .async_rollouts import step_metrics as async_step_metrics
from .checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import ConfigError, TrainConfig, config_from_argv, rollout_config, torchrun_command, vllm_backend
from .data import TaskSampler, concat_rollouts, count_tasks, derive_seed
from .distributed import Dist, full_tensor, init_distributed, shard_model
from .evaluate import per_task_rewards, screened_tasks
from .metrics import MetricsLog
from .policy import TokenLogprobs, causal_lm, load_model, load_tokenizer, trainable_parameters
from .update import UPDATE_SUMS, frozen_logprobs, grpo_update, lr_lambda


class Trainer:
    """The GRPO loop. ``Trainer(cfg).run()`` trains ``cfg.total_steps`` steps (resuming from the last
    checkpoint in ``cfg.out_dir`` when there is one) and returns the per-step metrics."""

    def __init__(self, cfg: TrainConfig, dist: Dist | None = None):
        cfg.validate()
        self.cfg = cfg
        self.dist = dist or Dist()
        d = self.dist
        if cfg.tasks_per_step % d.world:
            raise ConfigError(f"tasks_per_step ({cfg.tasks_per_step}) must be a multiple of the number of "
                              f"processes ({d.world})")
        # starts no process yet: rank 0's worker starts in run(), after any resume
        self.async_rollouts = AsyncRollouts(self) if cfg.async_rollouts else None
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % (2 ** 32))
        torch.manual_seed(cfg.seed)
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        # the splits, tokenizer and model first: a misspelt one is refused before the run folder exists
        n_train = count_tasks(cfg.env_id, cfg.train_split)
        n_eval = count_tasks(cfg.env_id, cfg.eval_split)
        self.train_task_ids = list(range(min(cfg.train_tasks, n_train) if cfg.train_tasks else n_train))
        if cfg.task_screen:
            keep = set(screened_tasks(cfg.task_screen, cfg.train_split, n_train, cfg.env_id))
            self.train_task_ids = [t for t in self.train_task_ids if t in keep]
            if not self.train_task_ids:
                raise ConfigError(f"task_screen {cfg.task_screen}: no task left to train on "
                                  f"(with train_tasks={cfg.train_tasks})")
        self.num_train_tasks = len(self.train_task_ids)
        self.eval_task_ids = list(range(min(cfg.eval_tasks, n_eval) if cfg.eval_tasks else n_eval))
        self.total_steps = cfg.total_steps(self.num_train_tasks)
        self.sampler = TaskSampler(self.num_train_tasks, cfg.tasks_per_step, cfg.seed)

        self.tokenizer = load_tokenizer(cfg)
        with models.loading_bars(cfg.progress):
            lm = load_model(cfg, self.tokenizer, d.device)
        self.ref = None
        if cfg.kl_coef > 0 and not cfg.lora:
            ref_lm = copy.deepcopy(lm).eval()
            for p in ref_lm.parameters():
                p.requires_grad_(False)
            self.ref = TokenLogprobs(ref_lm, cfg.logprob_chunk_size, cfg.temperature)
        # Rollouts need whole weights on every rank; under FSDP they come from an unsharded copy that
        # is refreshed after every update (on GPUs, vLLM's engine plays this part).
        self.rollout_lm = copy.deepcopy(lm).eval() if d.enabled else None
        self.policy = TokenLogprobs(lm, cfg.logprob_chunk_size, cfg.temperature, entropy_grad=cfg.entropy_coef > 0)
        if d.enabled:
            shard_model(self.policy, d, cfg.dtype == "bfloat16")
            if self.ref is not None:
                shard_model(self.ref, d, cfg.dtype == "bfloat16")
        params = trainable_parameters(self.policy)
        if not params:
            raise ConfigError("the policy has no trainable parameter")
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           weight_decay=cfg.weight_decay)
        self.total_updates = self.total_steps * cfg.ppo_epochs * cfg.num_minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_updates))
        self.backend = self._make_backend()
        if d.main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.step_idx = 0
        self.history: list[dict] = []
        self.log_lines = False  # one printed line a step when there is no progress bar (the command line sets it)
        self.log = MetricsLog(self.out_dir / "metrics.csv", enabled=d.main,
                              tensorboard_dir=self.out_dir / "tb" if cfg.tensorboard else None)
        self._t_start = time.perf_counter()
        self._elapsed_before = 0.0
        self._runs = 0  # run() calls so far: a later one goes on from this trainer's own state

    # -- rollouts ---------------------------------------------------------------------------------
    def _generation_model(self) -> nn.Module:
        return self.rollout_lm if self.rollout_lm is not None else self.policy.lm

    def _make_backend(self):
        from .. import rollout

        # With async_rollouts the training rollouts come from the worker (which holds the vLLM engine, if
        # any); the learner's own backend serves its evaluations only, and a second engine beside the
        # worker's would take memory for nothing.
        if self.cfg.rollout_backend == "vllm" and not self.cfg.async_rollouts:
            return vllm_backend(self.cfg, self._merged_for_vllm(), self.tokenizer)
        return rollout.HFBackend(self._generation_model(), self.tokenizer)

    def _merged_for_vllm(self) -> nn.Module:
        model = self._generation_model()
        if self.cfg.lora:  # vLLM gets plain weights: the adapters merged into a copy
            model = copy.deepcopy(model).merge_and_unload()
        return causal_lm(model)

    @torch.no_grad()
    def _sync_rollout_weights(self) -> None:
        if self.rollout_lm is not None:
            target = dict(self.rollout_lm.named_parameters())
            for name, p in self.policy.lm.named_parameters():
                target[name].copy_(full_tensor(p.detach()).to(target[name].dtype))
        if hasattr(self.backend, "update_weights"):  # a vLLM engine holds its own copy of the weights
            self.backend.update_weights(self._merged_for_vllm())

    def _collect(self, tasks: list[int], split: str, group_size: int, temperature: float,
                 seed_key: tuple) -> list:
        """Rollouts for ``tasks`` (this rank's share), in calls of ``rollout_tasks_per_call`` tasks.

        The sampling seed is a function of the run seed and ``seed_key`` only, and collect_rollouts
        derives every episode's seed from it, the task and the member index, so what is sampled does
        not depend on how the tasks are split among processes or calls (up to the float rounding of
        different batch shapes). A task drawn twice in one step would get the same samples twice."""
        from .. import rollout

        per_call = self.cfg.rollout_tasks_per_call or max(1, len(tasks))
        model = self._generation_model()
        was_training = model.training
        model.eval()
        out = []
        seed = derive_seed(self.cfg.seed, *seed_key) & 0x7FFFFFFF
        try:
            for i in range(0, len(tasks), per_call):
                torch.manual_seed(seed)
                rcfg = rollout_config(self.cfg, seed, group_size, temperature)
                out.append(rollout.collect_rollouts(self.backend, self.tokenizer, self.cfg.env_id,
                                                    tasks[i:i + per_call], split, rcfg))
        finally:
            model.train(was_training)
        return out

    # -- log-probs ----------------------------------------------------------------------------------
    def _frozen_logprobs(self, rows: dict, which: str, only: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) log-probs of the reference policy (``which="ref"``) or of the current policy
        before any update (``"old"``), for the rows ``only`` (default: all; the others stay 0)."""
        if which == "ref" and self.ref is None:  # LoRA: the base model is the reference
            return frozen_logprobs(self.policy, rows, self.cfg, self.dist, only, disable_adapter=True)
        module = self.ref if which == "ref" else self.policy
        return frozen_logprobs(module, rows, self.cfg, self.dist, only)

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> dict:
        """Sample, score and learn from one batch of tasks; returns this step's metrics."""
        step = self.step_idx + 1
        begin = self.elapsed()
        t0 = time.perf_counter()
        rows = self._collect_step(step) if self.async_rollouts is None else self.async_rollouts.next_rows(step)
        t_roll = time.perf_counter() - t0
        advantages, train_rows = self._advantages(rows)
        ref = self._frozen_terms(rows, train_rows)
        acc = grpo_update(self.policy, self.optimizer, self.scheduler, rows, advantages, train_rows, ref,
                          self.cfg, self.dist)
        self._sync_rollout_weights()
        if self.async_rollouts is not None:
            self.async_rollouts.publish(step)  # the weights after `step` updates
        t_upd = time.perf_counter() - t0 - t_roll
        row = {"step": step, **self._step_metrics(rows, train_rows, acc), "rollout_s": t_roll,
               "update_s": t_upd, "step_start_s": begin, **async_step_metrics(self, acc)}
        self.step_idx = step
        return row

    def _collect_step(self, step: int) -> dict:
        """This rank's share of the step's tasks, rolled out: the batch as one dict of (B, L) tensors."""
        c, d = self.cfg, self.dist
        tasks = [self.train_task_ids[i] for i in self.sampler.next_batch()]
        n_local = c.tasks_per_step // d.world
        first = d.rank * n_local
        batches = self._collect(tasks[first:first + n_local], c.train_split, c.group_size,
                                c.temperature, ("train", step))
        rows = concat_rollouts(batches, pad_id=self.tokenizer.pad_token_id or 0)
        rows["loss_mask"] = rows["loss_mask"].float()
        return rows

    def _advantages(self, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) group advantages, and (B,) bool: the rows the update runs on (all, or with
        ``drop_uniform_groups`` those of groups with a reward signal)."""
        c = self.cfg
        adv = grpo.group_advantages(rows["rewards"], rows["group_ids"], norm_by_std=c.norm_adv_by_std)
        train_rows = torch.ones(len(adv), dtype=torch.bool)
        if c.drop_uniform_groups:
            train_rows = grpo.rows_with_signal(rows["rewards"], rows["group_ids"])
        return adv, train_rows

    def _frozen_terms(self, rows: dict, train_rows: torch.Tensor) -> torch.Tensor | None:
        """The reference log-probs (None without KL) and, with ``old_logprobs="recompute"``, the
        trainer's own old log-probs written into ``rows`` in place of the sampling ones (which stay in
        ``rows["sampler_logprobs"]`` for the sampler/trainer gap metrics)."""
        c = self.cfg
        train_idx = train_rows.nonzero().flatten()
        if c.old_logprobs == "recompute":
            old = self._frozen_logprobs(rows, "old", train_idx)
            rows["sampler_logprobs"] = rows["old_logprobs"]
            rows["old_logprobs"] = torch.where(train_rows[:, None], old, rows["old_logprobs"])
        return self._frozen_logprobs(rows, "ref", train_idx) if c.kl_coef > 0 else None

    def _step_metrics(self, rows: dict, train_rows: torch.Tensor, acc: dict) -> dict:
        """The step's row of ``metrics.csv`` (without step and timings): sums over ranks, then means,
        so that every rank logs the same numbers."""
        rewards = rows["rewards"].double()
        n_groups = len(torch.unique(rows["group_ids"]))
        groups_equal = grpo.reward_metrics(rewards, rows["group_ids"])["frac_groups_no_signal"]
        local = {"reward": float(rewards.sum()), "reward_sq": float((rewards * rewards).sum()),
                 "successes": float((rewards >= 1 - 1e-6).sum()), "trajectories": float(len(rewards)),
                 "groups_equal": groups_equal * n_groups, "groups": float(n_groups),
                 "tokens_policy": float(rows["loss_mask"].sum()), "tokens_total": float(rows["attention_mask"].sum()),
                 "turns": float(sum(float(s.get("turns", 0)) for s in rows["stats"])),
                 **{k: acc[k] for k in UPDATE_SUMS if k != "grad_norm"},
                 "updated": float(train_rows.sum())}
        s = self.dist.reduce(local, "sum")
        ratio_max = self.dist.reduce({"ratio_max": acc["ratio_max"]}, "max")["ratio_max"]
        n, mean = s["trajectories"], s["reward"] / s["trajectories"]
        var = max(0.0, (s["reward_sq"] - n * mean * mean) / max(1.0, n - 1))
        upd = acc["updates"]  # the same on every rank

        def per_update(v: float) -> float | None:  # empty when no optimizer step was taken
            return v / upd if upd else None

        def per_token(v: float) -> float | None:
            return v / s["tokens"] if s["tokens"] else None

        return {
            "epoch": self.sampler.epoch + self.sampler.cursor / self.num_train_tasks,
            "tasks": self.cfg.tasks_per_step, "trajectories": int(n), "trajectories_updated": int(s["updated"]),
            "reward_mean": mean, "reward_std": math.sqrt(var), "success_rate": s["successes"] / n,
            "frac_groups_all_equal": s["groups_equal"] / max(1.0, s["groups"]),
            "tokens_policy": int(s["tokens_policy"]), "tokens_total": int(s["tokens_total"]),
            "turns_mean": s["turns"] / n, "loss": per_update(s["loss"]), "pg_loss": per_update(s["pg_loss"]),
            "kl": per_update(s["kl"]), "entropy": per_token(s["entropy_tok"]), "clip_frac": per_token(s["clip_tok"]),
            "ratio_mean": per_token(s["ratio_tok"]), "ratio_max": ratio_max if upd else None,
            "logp_gap_rollout": s["gap_abs"] / s["gap_tokens"] if s["gap_tokens"] else None,
            "rollout_clip_frac": s["gap_out"] / s["gap_tokens"] if s["gap_tokens"] else None,
            "grad_norm": per_update(acc["grad_norm"]), "lr": self.scheduler.get_last_lr()[0],
        }

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Mean reward and pass^k on the held-out tasks, ``eval_samples`` samples per task.

        The sampling seeds are the same at every evaluation (common random numbers), so the curve
        moves because the policy changed, not because the dice did. Success = reward >= 1."""
        from ..envs import pass_hat_k

        c, d = self.cfg, self.dist
        ids = self.eval_task_ids
        share = math.ceil(len(ids) / d.world)
        first = d.rank * share
        mine = ids[first:first + share]
        rewards_local: dict[int, list[float]] = {}
        if mine:
            batches = self._collect(mine, c.eval_split, c.eval_samples, c.eval_temperature, ("eval",))
            rewards_local = per_task_rewards(batches, mine, first)
        merged: dict[int, list[float]] = {}
        for part in d.gather_objects(rewards_local):
            merged.update(part)
        rewards = [merged[t] for t in sorted(merged)]
        flat = [r for rs in rewards for r in rs]
        successes = [[r >= 1 - 1e-6 for r in rs] for rs in rewards]
        k = c.eval_samples
        return {"eval_reward": float(np.mean(flat)) if flat else float("nan"),
                "eval_pass1": float(pass_hat_k(successes, 1)) if flat else float("nan"),
                "eval_passk": float(pass_hat_k(successes, k)) if flat else float("nan"), "eval_k": k}

    # -- checkpoints ---------------------------------------------------------------------------------
    def _state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # LoRA: the frozen base comes back from cfg.model; only what trains is saved.
        return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.cfg.lora,
                                strict=not self.cfg.lora)

    def save(self) -> Path:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.policy, self.optimizer, options=self._state_options())
        payload = {
            "model": model_sd,
            "optimizer": optim_sd,
            "trainer": {"step": self.step_idx, "scheduler": self.scheduler.state_dict(),
                        "sampler": self.sampler.state_dict(), "train_task_ids": self.train_task_ids,
                        "config": self.cfg.to_dict(), "attention": self._attention_settings(),
                        "start_digest": self._start_digest(),
                        "elapsed_s": self.elapsed(), "world_size": self.dist.world},
        }
        return save_checkpoint(self.ckpt_dir, self.step_idx, payload, rank_payload={"rng": rng_state()},
                               dist=self.dist, keep=self.cfg.keep_checkpoints)

    def try_resume(self) -> Path | None:
        """Load the newest complete checkpoint of ``out_dir`` (all ranks agree on which)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = latest_checkpoint(self.ckpt_dir) if self.cfg.resume else None
        name = self.dist.gather_objects(path.name if path else None)[0]
        if name is None:
            if self.dist.main:
                self.log.truncate_after(-1)
                old = [] if self.cfg.resume else list_checkpoints(self.ckpt_dir)
                if old:  # resume=False: an earlier run's checkpoints would outlive (and outrank) this run's
                    print(f"resume off: removing {len(old)} checkpoint(s) of an earlier run in {self.ckpt_dir}",
                          file=sys.stderr, flush=True)
                    for ckpt in old:
                        shutil.rmtree(ckpt)
                    (self.ckpt_dir / "latest").unlink(missing_ok=True)
            self.dist.barrier()
            return None
        path = self.ckpt_dir / name
        payload, rank_payload = load_checkpoint(path, self.dist.rank)
        state = payload["trainer"]
        saved = state["config"]
        changed = {k: (saved.get(k), v) for k, v in self.cfg.to_dict().items()
                   if k not in ("steps", "epochs", "max_minutes", "out_dir", "progress", "tensorboard", "resume",
                                "eval_every", "save_every", "keep_checkpoints", "threads") and saved.get(k) != v}
        if changed:
            raise ConfigError(f"{path} was written with a different config; differing keys "
                              f"(checkpoint, now): {changed}. Use another out_dir or --no-resume.")
        if state.get("train_task_ids", self.train_task_ids) != self.train_task_ids:
            raise ConfigError(f"{path} trained on other tasks than this run would ({len(state['train_task_ids'])} "
                              f"against {self.num_train_tasks}: has the task_screen file changed?). "
                              "Use another out_dir or --no-resume.")
        saved_attention = state.get("attention", self._attention_settings())
        if saved_attention != self._attention_settings():
            raise ConfigError(f"{path} was trained with the attention {saved_attention}, this run would use "
                              f"{self._attention_settings()} (has {Path(self.cfg.out_dir, 'sinkflex_sinks.json')} "
                              "or the layer_sinks file changed?). Use another out_dir or --no-resume.")
        then, now = state.get("start_digest"), self._start_digest()
        if then and now != then:  # the reference (and a LoRA run's base) is read from cfg.model again
            raise ConfigError(f"{path} was trained from other weights of {self.cfg.model} (digest {then}, now "
                              f"{now}): was the start policy trained again? Resuming would measure KL to, and "
                              "with LoRA train on, other weights. Use another out_dir or --no-resume.")
        set_state_dict(self.policy, self.optimizer, model_state_dict=payload["model"],
                       optim_state_dict=payload["optimizer"], options=self._state_options())
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step_idx = int(state["step"])
        self._elapsed_before = float(state.get("elapsed_s", 0.0))
        if rank_payload is not None and state.get("world_size") == self.dist.world:
            set_rng_state(rank_payload["rng"])
        self._sync_rollout_weights()
        if self.dist.main:
            self.log.truncate_after(self.step_idx)
        return path

    def _start_digest(self) -> str | None:
        """The digest of the start policy's saved weights (a folder ``cfg.model``; None for a random or a
        hub model), read once by the main rank and shared: a checkpoint records it, a resume compares it."""
        if not hasattr(self, "_start_digest_value"):
            from .evaluate import policy_digest

            folder = Path(self.cfg.model)
            mine = policy_digest(folder) if self.dist.main and self.cfg.model != "tiny" and folder.is_dir() else None
            self._start_digest_value = self.dist.gather_objects(mine)[0]
        return self._start_digest_value

    def _attention_settings(self) -> dict | None:
        """The sink attention the policy trains with (sink counts per layer, window), None for stock
        attention: recorded in every checkpoint, so that a resumed run cannot switch counts silently."""
        from .. import attention

        return attention.attention_settings(causal_lm(self.policy.lm))

    def elapsed(self) -> float:
        """Seconds of training so far, over resumes (the ``elapsed_s`` clock of the metrics)."""
        return self._elapsed_before + time.perf_counter() - self._t_start

    def _time_up(self) -> bool:
        """Whether the time budget is used up. Under torchrun every rank reads its own clock, and the
        clocks start apart (each rank's set-up takes its own time), so the ranks agree here: the budget
        is up once it is on any rank. Otherwise one rank would evaluate, save and stop while another
        steps on, and their collectives would no longer match. Every rank calls this at the same points."""
        up = self.cfg.max_minutes > 0 and self.elapsed() >= 60 * self.cfg.max_minutes
        if self.cfg.max_minutes > 0 and self.dist.enabled:
            up = self.dist.reduce({"up": float(up)}, "max")["up"] > 0
        return up

    # -- the loop ------------------------------------------------------------------------------------
    def _save_run_info(self) -> None:
        if not self.dist.main:
            return
        from ..provenance import provenance

        (self.out_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1) + "\n")
        info = provenance(seed=self.cfg.seed, world_size=self.dist.world, total_steps=self.total_steps,
                          num_train_tasks=self.num_train_tasks, train_task_ids=self.train_task_ids,
                          eval_tasks=len(self.eval_task_ids),
                          parameters=sum(p.numel() for p in self.policy.parameters()),
                          trainable_parameters=sum(p.numel() for p in trainable_parameters(self.policy)))
        (self.out_dir / "run_info.json").write_text(json.dumps(info, indent=1) + "\n")

    def _eval_due(self, step: int) -> bool:
        e = self.cfg.eval_every
        return step == 0 or step == self.total_steps or (e > 0 and step % e == 0)

    def _save_due(self, step: int) -> bool:
        s = self.cfg.save_every
        return step == self.total_steps or (s > 0 and step % s == 0)

    def run(self, max_steps: int | None = None) -> list[dict]:
        """Train until ``total_steps`` (or ``max_steps`` more steps); returns the rows logged."""
        # A later call on the same trainer carries on from where the last one stopped: resuming again
        # would load an older checkpoint (or none, and then empty metrics.csv) under the steps it took.
        again = self._runs > 0
        self._runs += 1
        # first: a refused resume leaves the folder's config.json as it was
        resumed = None if again else self.try_resume()
        self._save_run_info()
        if self.async_rollouts is not None:  # the worker starts while the first evaluation runs
            self.async_rollouts.start()
        bar = None
        if self.dist.main and self.cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step_idx, desc="grpo", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
            if resumed:
                bar.write(f"resumed from {resumed}")
        try:
            if self.step_idx == 0 and resumed is None and not again:
                t0 = time.perf_counter()
                row = {"step": 0, **self.evaluate()}
                row["eval_s"] = time.perf_counter() - t0
                row["elapsed_s"] = self.elapsed()
                self._emit(row, bar)
            done = 0
            # a run resumed after its time budget was used up (it stopped on it) takes no further step
            spent = (resumed is not None or again) and self._time_up()
            while self.step_idx < self.total_steps and (max_steps is None or done < max_steps) and not spent:
                t0 = time.perf_counter()
                row = self.step()
                time_up = self._time_up()
                if self._eval_due(self.step_idx) or time_up:
                    t1 = time.perf_counter()
                    row.update(self.evaluate())
                    row["eval_s"] = time.perf_counter() - t1
                    # an evaluation that used up the budget is the final one: no further step and eval
                    time_up = self._time_up()
                row["step_s"] = time.perf_counter() - t0
                row["elapsed_s"] = self.elapsed()
                self._emit(row, bar)
                if self._save_due(self.step_idx) or time_up:
                    self.save()
                done += 1
                if time_up:
                    if bar is not None:
                        bar.write(f"time budget of {self.cfg.max_minutes} min used up at step {self.step_idx}")
                    break
            if self.step_idx >= self.total_steps or self._time_up():
                exported = self.export_policy()
                if bar is not None:
                    bar.write(f"policy saved to {exported}")
        finally:
            if bar is not None:
                bar.close()
            self.log.close()
            if self.async_rollouts is not None:
                self.async_rollouts.close()
        return self.history

    def export_policy(self, path: str | os.PathLike | None = None) -> Path:
        """Save the policy as it is now as a Hugging Face folder (default ``out_dir/policy``, written
        at the end of every run) with the tokenizer beside it. Full fine-tuning: the whole model,
        ``AutoModelForCausalLM.from_pretrained(path)``. LoRA: peft's adapter files, for
        ``peft.AutoPeftModelForCausalLM.from_pretrained(path)`` over the base ``cfg.model``. Learned
        sink logits are saved too (in the model's weights, or ``sink_logits.safetensors`` beside
        LoRA adapters), and the sink settings in ``sinkflex_attention.json``:
        ``models.load_policy(path)`` loads the policy with all of them. Under FSDP every rank holds the
        whole weights in its rollout copy; the main process writes them. Returns the folder."""
        path = Path(path) if path is not None else self.out_dir / "policy"
        lm = self.rollout_lm if self.rollout_lm is not None else self.policy.lm
        if self.dist.main:
            from safetensors.torch import save_file

            from .. import attention

            path.mkdir(parents=True, exist_ok=True)
            with models.loading_bars(self.cfg.progress):
                lm.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            attention.save_attention_settings(lm, path)  # LoRA folders have no config.json to carry them
            sinks = {n: p.detach().cpu().contiguous() for n, p in lm.named_parameters()
                     if n.endswith("sinkflex_sink_logits")}
            if self.cfg.lora and sinks:
                save_file(sinks, str(path / "sink_logits.safetensors"))
            else:  # an earlier LoRA run's file in this folder would be read as this policy's sinks
                (path / "sink_logits.safetensors").unlink(missing_ok=True)
        self.dist.barrier()
        return path

    def _emit(self, row: dict, bar) -> None:
        self.history.append(row)
        self.log.write(row)
        if bar is None and self.log_lines and self.dist.main:  # the command line without its bar: a line a step
            parts = [f"step {row['step']}/{self.total_steps}"]
            for key, name in (("reward_mean", "reward"), ("eval_reward", "eval"), ("kl", "kl")):
                if row.get(key) is not None:
                    parts.append(f"{name} {row[key]:.3f}")
            if row.get("step_s") is not None:
                parts.append(f"{row['step_s']:.1f} s")
            print(", ".join(parts), flush=True)
        if bar is not None:
            if row["step"] > 0:
                bar.update(1)
            post = {}
            if row.get("reward_mean") is not None:
                post["reward"] = f"{row['reward_mean']:.3f}"
            if row.get("eval_reward") is not None:
                post["eval"] = f"{row['eval_reward']:.3f}"
            if row.get("step_s") is not None:
                post["step_s"] = f"{row['step_s']:.1f}"
            bar.set_postfix(post, refresh=True)



def main(argv: list[str] | None = None) -> int:
    """``sinkflex train ...`` and ``torchrun ... -m sinkflex_core.train ...``; returns an exit code."""
    from ..provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:  # `sinkflex train -- --lr 1e-4`: the separator some launchers need
        argv = argv[1:]
    try:
        cfg, args = config_from_argv(argv)
    except ConfigError as err:
        print(f"sinkflex train: config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=1))
        print("\n# on one node with 8 GPUs:\n" + torchrun_command(cfg, 8))
        return 0
    if not cfg.progress:  # transformers' own bars (loading and writing weights) too
        from .. import models

        models.hide_loading_bars()
    dist = init_distributed()
    if cfg.model == "tiny" and dist.main:  # said once, not by every rank
        print("sinkflex train: note: model=tiny is a randomly initialised policy; it solves no task, so every "
              "group's rewards are equal and nothing is learned (drop_uniform_groups skips them). GRPO as in "
              "the tutorials starts from the shipped start: --model data/retail-tiny-start", file=sys.stderr)
    try:
        trainer = Trainer(cfg, dist)
        trainer.log_lines = not cfg.progress
        rows = trainer.run()
    except ConfigError as err:
        print(f"sinkflex train: config error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if dist.main and rows:
        last = rows[-1]
        print(f"done: step {trainer.step_idx}/{trainer.total_steps}; last eval reward "
              f"{next((r['eval_reward'] for r in reversed(rows) if r.get('eval_reward') is not None), 'n/a')}; "
              f"log {trainer.out_dir / 'metrics.csv'}; last step {last.get('step_s') or 0:.1f} s")
        if (trainer.out_dir / "policy").is_dir():
            print(f"policy (Hugging Face folder): {trainer.out_dir / 'policy'}")
    elif dist.main:
        print(f"nothing to do: {trainer.out_dir} holds a finished run (step {trainer.step_idx}/"
              f"{trainer.total_steps}); --no-resume or another --out-dir starts a new one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
