"""How often a policy solves the tasks: per-task rewards of rollouts, success counts and tables
(pass@k, ``benchmarks/pass_at_k.py``), the task screen a run may train on (``task_screen``), and the
reward-curve tables of recorded runs (``benchmarks/reproduce_curve.py``, notebook 05)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..paths import atomic_path
from .checkpoint import file_digest
from .config import ConfigError, resolve_config, rollout_config
from .data import count_tasks, derive_seed


def screened_tasks(path: str | Path, split: str, num_tasks: int, env_id: str = "sinkflex/Retail-v0") -> list[int]:
    """The tasks of ``split`` that a screening run solved sometimes but not always.

    ``path`` is a CSV with one row per task and the columns ``task``, ``successes`` and ``tries``, as
    ``benchmarks/pass_at_k.py --split train --out FILE`` writes it (its ``split`` column, if any, must
    name ``split``). A task the policy never solves gives GRPO no signal, and neither does one it always
    solves: every group of it has equal rewards. Screening the start once and training on the rest (the
    offline form of the dynamic sampling of DAPO) spends the rollouts where the advantages are not 0.
    """
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task_screen: no such file {path}")
    table = pd.read_csv(path)
    missing = {"task", "successes", "tries"} - set(table.columns)
    if missing:
        raise ConfigError(f"task_screen {path}: missing column(s) {sorted(missing)} "
                          "(write it with benchmarks/pass_at_k.py --out)")
    if "split" in table.columns and set(table["split"].astype(str)) != {split}:
        raise ConfigError(f"task_screen {path} screens split(s) {sorted(set(table['split'].astype(str)))}, "
                          f"but train_split is {split!r}")
    bad = table[(table["task"] < 0) | (table["task"] >= num_tasks) | (table["successes"] < 0)
                | (table["successes"] > table["tries"])]
    if len(bad):
        raise ConfigError(f"task_screen {path}: every row needs a task id in [0, {num_tasks}) and "
                          f"0 <= successes <= tries; first bad row: {bad.iloc[0][['task', 'successes', 'tries']].to_dict()}")
    if table["task"].duplicated().any():
        raise ConfigError(f"task_screen {path}: task {int(table['task'][table['task'].duplicated()].iloc[0])} "
                          "has more than one row")
    versions = set(table["reward_version"]) if "reward_version" in table.columns else {1}
    if versions != {reward_version(env_id)}:
        warnings.warn(f"task_screen {path} was made under reward version(s) {sorted(versions)}, not the "
                      f"current {reward_version(env_id)}: the successes may differ now (screen again)", stacklevel=2)
    keep = table[(table["successes"] > 0) & (table["successes"] < table["tries"])]
    return sorted(int(t) for t in keep["task"])


def reward_version(env_id: str = "sinkflex/Retail-v0") -> int:
    """The version of ``env_id``'s reward (a task screen made under another one may be stale)."""
    from ..envs.worlds import world_of

    return world_of(env_id).reward_version


def per_task_rewards(batches: list, tasks: list[int], first_pos: int) -> dict[int, list[float]]:
    """Rewards of each task's samples, keyed by the task's global position: the batches hold the
    groups of ``tasks`` in order (one group per task, as collect_rollouts returns them)."""
    out: dict[int, list[float]] = {}
    pos = first_pos
    for b in batches:
        gids = torch.as_tensor(b.group_ids)
        order = list(dict.fromkeys(gids.tolist()))  # group ids in order of appearance
        rewards = torch.as_tensor(b.rewards, dtype=torch.float64)
        for g in order:
            out[pos] = rewards[gids == g].tolist()
            pos += 1
    if len(out) != len(tasks):
        raise RuntimeError(f"expected one group per task ({len(tasks)}), got {len(out)} groups")
    return out


# --------------------------------------------------------------------------------------------------
# Screening tasks: how often a saved policy solves each task (benchmarks/pass_at_k.py, task_screen)
# --------------------------------------------------------------------------------------------------

def task_kinds(split: str, tasks: list[int], env_id: str = "sinkflex/Retail-v0") -> list[str]:
    """Each task's write actions (``+``-joined), ``"read only"`` for a task that changes nothing."""
    from ..envs.worlds import world_of

    all_tasks = world_of(env_id).get_tasks(split)
    return ["+".join(sorted({a["name"] for a in all_tasks[t]["actions"]})) or "read only" for t in tasks]


def success_counts(backend, tokenizer, split: str, tasks: list[int], samples: int, tasks_per_call: int = 8,
                   seed: int = 0, progress: bool = True, env_id: str = "") -> list[int]:
    """Successful episodes (reward 1) out of ``samples`` for each task, played by ``backend`` (a
    :class:`sinkflex_core.rollout.HFBackend` around the policy, or any generation backend) with the
    rollout settings of the tiny-cpu preset at its evaluation temperature."""
    from tqdm.auto import tqdm

    from ..rollout import collect_rollouts

    cfg = resolve_config("tiny-cpu")
    chunks = [tasks[i:i + tasks_per_call] for i in range(0, len(tasks), tasks_per_call)]
    batches = []
    with torch.no_grad():
        for n, chunk in enumerate(tqdm(chunks, desc="rollouts per task", unit="call", disable=not progress)):
            call_seed = derive_seed(seed, "pass_at_k", n) & 0x7FFFFFFF
            torch.manual_seed(call_seed)
            batches.append(collect_rollouts(backend, tokenizer, env_id or cfg.env_id, chunk, split,
                                            rollout_config(cfg, call_seed, group_size=samples,
                                                           temperature=cfg.eval_temperature)))
    rewards = per_task_rewards(batches, tasks, 0)  # task position -> its samples' rewards, in order
    return [sum(r >= 1 - 1e-6 for r in rewards[i]) for i in range(len(tasks))]


def policy_digest(policy_dir: str | os.PathLike) -> str:
    """The first 16 hex digits of the SHA-256 of a saved policy's weights (``model.safetensors``; for
    LoRA adapters or sharded weights, of the digests of all its ``*.safetensors`` files in name order)."""
    folder = Path(policy_dir)
    if (folder / "model.safetensors").is_file():
        return file_digest(folder / "model.safetensors")[:16]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    return hashlib.sha256("".join(file_digest(f) for f in files).encode()).hexdigest()[:16]


def attention_label(sinks: dict | None, saved_attention: bool = True) -> str:
    """How a table names the attention a policy was played with: ``"saved"`` (the folder's own),
    ``"full"`` (full attention in place of the folder's sink attention, ``saved_attention=False``) or
    ``"sinkflex(n_sink=4,window=256,layer_sinks=[..])"`` for the settings given to :func:`success_table`."""
    if not saved_attention:
        return "full"
    if not sinks:
        return "saved"
    sinks = dict(sinks)
    if isinstance(sinks.get("layer_sinks"), str | os.PathLike):  # the counts, not where they were read
        from ..attention import load_layer_sinks

        sinks["layer_sinks"] = load_layer_sinks(sinks["layer_sinks"])
    return "sinkflex(" + ",".join(f"{k}={sinks[k]}" for k in sorted(sinks)).replace(" ", "") + ")"


def success_table(policy_dir: str | os.PathLike, split: str, tasks: list[int], samples: int,
                  tasks_per_call: int = 8, seed: int = 0, progress: bool = True,
                  env_id: str = "sinkflex/Retail-v0", sinks: dict | None = None,
                  saved_attention: bool = True) -> Any:
    """One row per task (its write actions, successes out of ``samples``) for the saved policy in
    ``policy_dir``, with the policy's folder name and weights digest, the settings and provenance.

    ``sinks``: keyword arguments of :func:`sinkflex_core.attention.apply` (``n_sink``, ``window``,
    ``layer_sinks``, ``learn_sinks``) to play a policy saved with plain attention with sink attention,
    as a GRPO run with ``attention="sinkflex"`` starts it; the ``attention`` column records them.
    ``saved_attention=False`` plays a policy saved with sink attention with full attention instead
    (:func:`sinkflex_core.models.load_policy`; column ``attention`` = ``"full"``)."""
    import pandas as pd

    from ..models import load_policy
    from ..models import load_tokenizer as load_saved_tokenizer
    from ..provenance import provenance
    from ..rollout import HFBackend

    start = time.perf_counter()
    if sinks and not saved_attention:
        raise ValueError("sinks= and saved_attention=False ask for two different attentions: pass one")
    # by default with the attention it was trained with (sinks, window, sink logits)
    model = load_policy(policy_dir, saved_attention=saved_attention)
    if sinks:
        from ..attention import apply, attention_settings

        if attention_settings(policy_dir) is not None:
            raise ValueError(f"{policy_dir} was saved with sink attention already: play it with its own (sinks=None)")
        apply(model, **sinks)
    tokenizer = load_saved_tokenizer(policy_dir)
    counts = success_counts(HFBackend(model, tokenizer), tokenizer, split, tasks, samples, tasks_per_call, seed,
                            progress, env_id)
    table = pd.DataFrame({"task": tasks, "kind": task_kinds(split, tasks, env_id), "successes": counts,
                          "tries": samples})
    table = table.assign(policy=Path(policy_dir).name, policy_digest=policy_digest(policy_dir), split=split,
                         attention=attention_label(sinks, saved_attention), reward_version=reward_version(env_id),
                         seed=seed, minutes=round((time.perf_counter() - start) / 60, 2))
    for key, value in provenance().items():
        table[key] = value
    return table


def screen_or_reuse(policy_dir: str | os.PathLike, path: str | os.PathLike, samples: int = 4,
                    split: str = "train", tasks: int = 0, seed: int = 0, progress: bool = True,
                    env_id: str = "sinkflex/Retail-v0", sinks: dict | None = None) -> Path:
    """Write ``path``, the screen of the first ``tasks`` tasks of ``split`` (0: all; ``samples``
    episodes each; pass it as ``task_screen``), unless it already holds one of these very weights (same
    ``policy_digest``, split, tasks, samples and seed) made under the current ``REWARD_VERSION``; returns ``path``. The tiny policy takes about 20
    minutes on 2 cores for the 600 training tasks x 4."""
    import pandas as pd

    path = Path(path)
    n = count_tasks(env_id, split)
    task_ids = list(range(min(tasks, n) if tasks else n))
    digest = policy_digest(policy_dir)
    if path.is_file():
        old = pd.read_csv(path, dtype={"policy_digest": str})  # a digest of digits only stays a string
        if ({"task", "policy_digest", "split", "tries", "reward_version"} <= set(old.columns)
                and list(old["task"]) == task_ids and set(old["policy_digest"].astype(str)) == {digest}
                and set(old["split"]) == {split} and set(old["tries"]) == {samples}
                and set(old["reward_version"]) == {reward_version(env_id)}
                and set(old.get("seed", [0])) == {seed}  # other sampling seeds: other episodes
                and set(old.get("attention", ["saved"])) == {attention_label(sinks)}):
            print(f"screen: reusing {path} (same policy weights)", file=sys.stderr, flush=True)
            return path
    print(f"screen: {len(task_ids)} {split} tasks x {samples} episodes of {policy_dir} -> {path}", file=sys.stderr,
          flush=True)
    table = success_table(policy_dir, split, task_ids, samples, seed=seed, progress=progress, env_id=env_id,
                          sinks=sinks)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        table.to_csv(tmp, index=False)
    kept = len(screened_tasks(path, split, n, env_id))
    print(f"screen: {kept} of {len(task_ids)} tasks solved sometimes but not always", file=sys.stderr, flush=True)
    return path


# --------------------------------------------------------------------------------------------------
# The small-scale reproduction: tables of reward curves (benchmarks/reproduce_curve.py,
# notebooks/05_grpo_training.ipynb)
# --------------------------------------------------------------------------------------------------

CURVE_COLUMNS = ["seed", "step", "elapsed_s", "eval_reward", "eval_pass1", "eval_passk", "eval_k", "reward_mean"]


def curve_table(run_dir: str | os.PathLike, seed: int, **extra) -> Any:
    """A run's ``metrics.csv`` as a DataFrame with ``seed`` and the run's provenance (``run_info.json``)
    and any ``extra`` columns added to every row."""
    import pandas as pd

    run_dir = Path(run_dir)
    df = pd.read_csv(run_dir / "metrics.csv")
    info_path = run_dir / "run_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    df.insert(0, "seed", seed)
    for key in ("date", "git_sha", "hardware", "torch", "transformers", "python", "world_size", "parameters",
                "trainable_parameters", "num_train_tasks"):
        if key in info:
            df[key] = info[key]
    for key, value in extra.items():
        df[key] = value
    return df


def evaluations(df) -> Any:
    """The rows of a curve table that hold an evaluation, by seed and step, with ``last_eval`` True on
    each seed's last one: the end of its curve (seeds stopped by a time limit end at different steps)."""
    ev = df[df["eval_reward"].notna()].sort_values(["seed", "step"], kind="stable").copy()
    ev["last_eval"] = ev["step"] == ev.groupby("seed")["step"].transform("max")
    return ev


def summarize_curves(df) -> Any:
    """One row per seed of a curve table: test reward at the first and last evaluation, the gain, the
    best evaluation, steps and minutes; plus a last row ``mean`` (and ``std``) over seeds."""
    import pandas as pd

    rows = []
    for seed, ev in evaluations(df).groupby("seed"):
        g = df[df["seed"] == seed]
        first, last = ev.iloc[0], ev[ev["last_eval"]].iloc[0]
        rows.append({"seed": seed, "start": float(first["eval_reward"]), "end": float(last["eval_reward"]),
                     "gain": float(last["eval_reward"] - first["eval_reward"]),
                     "best": float(ev["eval_reward"].max()), "pass1_end": float(last["eval_pass1"]),
                     "passk_end": float(last["eval_passk"]), "steps": int(g["step"].max()),
                     "minutes": float(g["elapsed_s"].max() / 60)})
    out = pd.DataFrame(rows)
    if len(out) > 1:
        num = out.drop(columns="seed")
        out = pd.concat([out, pd.DataFrame([{"seed": "mean", **num.mean().to_dict()},
                                            {"seed": "std", **num.std().to_dict()}])], ignore_index=True)
    return out


def bootstrap_mean(values, draws: int = 4000, seed: int = 0, rng=None) -> tuple[float, float, float]:
    """The mean of ``values`` (one number per task) and a 95 % bootstrap interval of it: the 2.5 % and
    97.5 % quantiles of the mean over ``draws`` resamples of the tasks with replacement, drawn by
    ``rng`` (a numpy Generator, to continue one stream over several intervals) or a new one from ``seed``."""
    import numpy as np

    values = np.asarray(values, float)
    rng = rng if rng is not None else np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (draws, len(values)))].mean(axis=1)
    return float(values.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def paired_gains(test, draws: int = 4000, seed: int = 0) -> Any:
    """The held-out gain of each run of a recording, with a paired bootstrap 95 % interval over tasks.

    ``test`` has one row per (``attention``, ``seed``, ``task``): ``start_successes`` (the start policy,
    played with that attention), ``end_successes`` (the run's final policy) and ``tries`` (episodes per
    task for each; the same sampling seeds for both, so the two differ only by the policy). Returns one
    row per attention and seed, then one per attention over all its seeds (``seed`` = "all": each task's
    gain averaged over the seeds first), with ``start``, ``end``, ``gain`` (means over tasks of the success
    rates), ``low`` and ``high`` (2.5 % and 97.5 % quantiles of the gain's mean when the tasks are drawn
    again with replacement, the same draw for the start and the end: paired), ``tasks`` and ``tries``."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)  # one stream for every row, in table order

    def row(attn, seed_label, start, end, tries, n_tasks):
        gain, low, high = bootstrap_mean(end - start, draws, rng=rng)
        return {"attention": attn, "seed": seed_label, "start": float(start.mean()), "end": float(end.mean()),
                "gain": gain, "low": low, "high": high, "tasks": n_tasks, "tries": tries}

    rows = []
    for attn, arm in test.groupby("attention", sort=False):
        per_task = []
        for s, g in arm.groupby("seed"):
            g = g.sort_values("task")
            start = g["start_successes"].to_numpy(float) / g["tries"].to_numpy(float)
            end = g["end_successes"].to_numpy(float) / g["tries"].to_numpy(float)
            rows.append(row(attn, s, start, end, int(g["tries"].iloc[0]), len(g)))
            per_task.append(pd.DataFrame({"task": g["task"].to_numpy(), "start": start, "end": end}))
        both = pd.concat(per_task).groupby("task")[["start", "end"]].mean()
        rows.append(row(attn, "all", both["start"].to_numpy(), both["end"].to_numpy(),
                        int(arm["tries"].iloc[0]) * arm["seed"].nunique(), len(both)))
    return pd.DataFrame(rows)


def gain_difference(test, a: str, b: str, draws: int = 4000, seed: int = 0) -> dict:
    """How much more attention ``a``'s runs gained than ``b``'s on the same held-out tasks (tables as in
    :func:`paired_gains`; each task's gain averaged over each attention's seeds), with a paired bootstrap
    95 % interval over tasks: ``{"difference", "low", "high", "tasks"}``."""
    def per_task(attn):
        arm = test[test["attention"] == attn]
        if arm.empty:
            raise ValueError(f"no rows with attention {attn!r} (have {sorted(test['attention'].unique())})")
        rate = (arm["end_successes"] - arm["start_successes"]) / arm["tries"]
        return arm.assign(g=rate).groupby("task")["g"].mean()

    ga, gb = per_task(a), per_task(b)
    common = ga.index.intersection(gb.index)
    difference, low, high = bootstrap_mean(ga.loc[common] - gb.loc[common], draws, seed)
    return {"difference": difference, "low": low, "high": high, "tasks": int(len(common))}


def async_summary(curve, test=None) -> Any:
    """One row per config of a sync/async recording (``benchmarks/async_curves.py``: ``data/async_curves.csv``
    and, if given, ``data/async_curves_test.csv``), over its seeds: steps; median and mean seconds a step
    without evaluations (step 1 left out: it includes the worker's start), the learner's wait for (or time in)
    rollouts, its update and the worker's rollout time; mean staleness; the training reward of the first
    and the last two steps; and the held-out success rate of the start and the final policies with the
    gain and its paired bootstrap 95 % interval over tasks (each task's gain averaged over the seeds)."""
    import pandas as pd

    rows = []
    for config, g in curve.groupby("config", sort=False):
        steps = g[g["step"] >= 2]
        first, last = g["step"][g["step"] >= 1].min(), g["step"].max()
        nan = float("nan")
        gain = low = high = start = end = nan
        if test is not None:
            per_task = test[test["config"] == config].groupby("task")[["start_rate", "end_rate"]].mean()
            gain, low, high = bootstrap_mean(per_task["end_rate"] - per_task["start_rate"])
            start, end = per_task["start_rate"].mean(), per_task["end_rate"].mean()
        step_s = steps["step_s"] - steps["eval_s"].fillna(0)
        rows.append({"config": config, "seeds": g["seed"].nunique(), "steps": int(last),
                     "step_s": step_s.median(), "step_s_mean": step_s.mean(),
                     "wait_s": steps["rollout_s"].median(), "update_s": steps["update_s"].median(),
                     "worker_s": steps["rollout_worker_s"].median() if "rollout_worker_s" in steps else nan,
                     "staleness": steps["staleness_mean"].mean() if "staleness_mean" in steps else nan,
                     "train_first2": g[g["step"].between(first, first + 1)]["reward_mean"].mean(),
                     "train_last2": g[g["step"].between(last - 1, last)]["reward_mean"].mean(),
                     "test_start": start, "test_end": end, "gain": gain, "low": low, "high": high})
    return pd.DataFrame(rows)
