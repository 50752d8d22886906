"""Figures drawn from recorded results (``data/*.csv``), for the notebooks and
``figures/*.png``: reward curves of GRPO runs and the memory of one GRPO step against trajectory
length. :func:`regenerate_figures` remakes every figure that ``data/`` holds the numbers of."""

from __future__ import annotations

from pathlib import Path

# The paper's retail reward: SFT start and end of GRPO training (Qwen2.5-7B-Instruct, 8 x H100).
PAPER_REWARD_START, PAPER_REWARD_END = 0.25, 0.44


def plot_reward_curves(df, ax=None, label: str = "", color: str | None = None, x: str = "step"):
    """Test reward (mean over held-out tasks) against ``x`` (``step`` or ``minutes``) for every seed of
    a curve table (thin lines), with the mean over seeds and its min-max band at the evaluations every
    seed reached, and the mean of each seed's last evaluation (a star; seeds stopped by a time limit end
    at different steps)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    from .train.evaluate import evaluations

    ev = evaluations(df)
    ev["minutes"] = ev["elapsed_s"] / 60
    seeds = sorted(ev["seed"].unique())
    for seed in seeds:
        g = ev[ev["seed"] == seed].sort_values("step")
        ax.plot(g[x], g["eval_reward"], color=color, alpha=0.35, lw=1,
                label=f"{label} seed {seed}" if len(seeds) == 1 else None)
    if len(seeds) > 1:
        shared = ev.groupby("step")["seed"].transform("nunique") == len(seeds)
        grid = ev[shared].groupby("step")
        mean, lo, hi = grid["eval_reward"].mean(), grid["eval_reward"].min(), grid["eval_reward"].max()
        xs = grid["minutes"].mean() if x == "minutes" else mean.index
        ax.plot(xs, mean.values, color=color, lw=2.2, marker="o", ms=3,
                label=f"{label} mean of {len(seeds)} seeds (band: min-max)")
        ax.fill_between(xs, lo.values, hi.values, color=color, alpha=0.15)
        last = ev[ev["last_eval"]]
        ax.plot([last[x].mean()], [last["eval_reward"].mean()], color=color, marker="*", ms=11, ls="none",
                label=f"{label} mean of each seed's last evaluation: {last['eval_reward'].mean():.3f}")
    ax.set_xlabel("GRPO step" if x == "step" else "minutes")
    ax.set_ylabel("mean test reward")
    ax.grid(alpha=0.3)
    return ax


ATTENTION_COLORS = {"sinkflex": "tab:blue", "sdpa": "tab:gray"}


def plot_training_reward(df, ax=None, label: str = "", color: str | None = None):
    """Training reward (mean reward of each step's episodes) against the GRPO step for every seed of a
    table of per-step metrics (thin lines), with the mean over seeds at the steps every seed reached."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    steps = df.dropna(subset=["reward_mean"])
    seeds = sorted(steps["seed"].unique())
    for seed in seeds:
        g = steps[steps["seed"] == seed].sort_values("step")
        ax.plot(g["step"], g["reward_mean"], color=color, alpha=0.35 if len(seeds) > 1 else 1.0, lw=1,
                label=f"{label} seed {seed}" if len(seeds) == 1 else None)
    if len(seeds) > 1:
        shared = steps.groupby("step")["seed"].transform("nunique") == len(seeds)
        mean = steps[shared].groupby("step")["reward_mean"].mean()
        ax.plot(mean.index, mean.values, color=color, lw=2.2, label=f"{label} mean of {len(seeds)} seeds")
    missing = sorted(set(df["seed"].dropna().unique()) - set(seeds))
    if missing:  # a run that recorded no step is named, not left out of the count unseen
        ax.plot([], [], " ", label=f"{label} no step recorded: seed {', '.join(map(str, missing))}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("training reward (mean of the step's 64 episodes)")
    ax.grid(alpha=0.3)
    return ax


def plot_test_gains(test, ax=None):
    """Held-out test reward of the start and of the final policies (a recording's ``reward_curve_test.csv``,
    :func:`sinkflex_core.train.paired_gains`), one line per attention over all its seeds: the means with
    95 % bootstrap intervals over tasks, and the gain with its paired interval in the legend."""
    import matplotlib.pyplot as plt
    import numpy as np

    from .train.evaluate import bootstrap_mean, paired_gains

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    gains = paired_gains(test)
    rng = np.random.default_rng(0)
    for i, (attention, arm) in enumerate(test.groupby("attention", sort=False)):
        per_task = arm.groupby("task")[["start_rate", "end_rate"]].mean()
        means, errs = [], [[], []]
        for col in ("start_rate", "end_rate"):
            mean, low, high = bootstrap_mean(per_task[col], rng=rng)
            means.append(mean)
            errs[0].append(mean - low)
            errs[1].append(high - mean)
        g = gains[(gains["attention"] == attention) & (gains["seed"] == "all")].iloc[0]
        xs = np.array([0, 1]) + (i - 0.5) * 0.08
        ax.errorbar(xs, means, yerr=errs, color=ATTENTION_COLORS.get(attention), marker="o", capsize=4, lw=2,
                    label=f"{attention}: {g['start']:.3f} -> {g['end']:.3f}, gain {g['gain']:+.3f} "
                          f"[{g['low']:+.3f}, {g['high']:+.3f}]")
    n_seeds = test.groupby("attention")["seed"].nunique().max()
    ax.set_xticks([0, 1], ["start", f"after GRPO ({n_seeds} seeds)"])
    ax.set_xlim(-0.4, 1.4)
    ax.set_ylabel("mean test reward")
    ax.grid(alpha=0.3)
    return ax


def reward_figure(curve=None, test=None, live=None):
    """The figure ``figures/reward_curve.png`` (notebooks 05 and 07) of a recording
    (``benchmarks/reproduce_curve.py``): the training reward per step of every run by attention
    (``data/reward_curve.csv``) and the held-out test reward of the start and the final policies with
    their intervals (``data/reward_curve_test.csv``), the paper's start and end beside them; ``live``, the
    per-step metrics of a run of one's own, is added in its own colour. Any of them may be None."""
    import matplotlib.pyplot as plt

    fig, (ax, ax1) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.4, 1]})
    if curve is not None:
        for attention, g in curve.groupby("attention", sort=False):
            plot_training_reward(g, ax=ax, label=f"{attention}:", color=ATTENTION_COLORS.get(attention))
    if live is not None:
        plot_training_reward(live, ax=ax, label="this run:", color="tab:orange")
    screened = curve is not None and "task_screen" in curve and curve["task_screen"].fillna("").astype(bool).any()
    on = "screened training tasks" if screened else "training tasks"
    ax.set_title(f"GRPO: training reward per step, {on} (data/reward_curve.csv)", fontsize=10)
    if test is not None:
        plot_test_gains(test, ax=ax1)
    # The paper's curve is its training reward on all its training tasks: beside a run on screened tasks
    # (the ones the start solved sometimes) the two compare different task sets, and the legend says so.
    for a in (ax, ax1):
        note = "; the paper's reward on all its training tasks" if a is ax and screened else ""
        a.axhline(PAPER_REWARD_START, color="grey", ls=":", lw=1, label=f"paper, start: {PAPER_REWARD_START}")
        a.axhline(PAPER_REWARD_END, color="grey", ls="--", lw=1,
                  label=f"paper, end: {PAPER_REWARD_END} (7B, 8 x H100{note})")
    tasks = f"{test['task'].nunique()} tasks x {int(test['tries'].iloc[0])}" if test is not None else "not recorded"
    ax1.set_title(f"held-out test reward ({tasks}; data/reward_curve_test.csv)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax1.legend(fontsize=7, loc="upper left")
    n_params = f"{curve['parameters'].iloc[0] / 1e6:.1f}M parameters, " \
        if curve is not None and "parameters" in curve else ""
    fig.suptitle(f"Retail store, tiny Qwen2 policy ({n_params}trained from scratch) on a 2-core CPU", fontsize=11)
    fig.tight_layout()
    return fig


TIMELINE_COLORS = {"rollout": "tab:blue", "update": "tab:orange", "wait": "0.85", "evaluation": "tab:green"}


def plot_timeline(timelines: dict, steps: tuple[int, int] = (2, 6), axes=None):
    """Timelines of runs side by side (:func:`sinkflex_core.train.step_timeline` tables by label, e.g.
    ``{"sync": ..., "async k=1": ...}``), one panel each, for steps ``steps[0]`` to ``steps[1]``: the
    learner's lane (its rollouts, or its wait for the worker's, then its updates) and, for an
    asynchronous run, the worker's lane. Each panel's clock starts at its first step shown, so the panels
    compare how long the same steps took."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if axes is None:
        _, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.1 + 1.0 * len(timelines)), sharex=True,
                               squeeze=False)
        axes = axes[:, 0]
    first, last = steps
    seen = set()
    for ax, (label, tl) in zip(axes, timelines.items()):
        shown = tl[(tl["step"] >= first) & (tl["step"] <= last) & (tl["activity"] != "evaluation")]
        if shown.empty:
            ax.set_title(f"{label}: no steps {first}-{last} with timings", fontsize=9)
            continue
        origin = shown[shown["lane"] == "learner"]["start"].min()
        lanes = ["learner", "worker"] if (shown["lane"] == "worker").any() else ["learner"]
        for y, lane in enumerate(lanes):
            for r in shown[shown["lane"] == lane].itertuples(index=False):
                ax.broken_barh([(r.start - origin, r.end - r.start)], (y - 0.35, 0.7),
                               facecolors=TIMELINE_COLORS[r.activity], edgecolor="white", linewidth=0.8)
                seen.add(r.activity)
                if lane == "learner" and r.activity == "update" and r.end - r.start > 0:
                    ax.text((r.start + r.end) / 2 - origin, y, str(r.step), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        learner = shown[shown["lane"] == "learner"]
        per_step = (learner["end"].max() - origin) / learner["step"].nunique()
        ax.set_title(f"{label}: steps {first}-{last}, {per_step:.1f} s a step", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("seconds from the first step shown")
    axes[0].legend(handles=[Patch(color=TIMELINE_COLORS[a], label="wait for rollouts" if a == "wait" else a)
                            for a in TIMELINE_COLORS if a in seen], fontsize=8, loc="lower right", ncol=4,
                   bbox_to_anchor=(1.0, 1.0), frameon=False, borderaxespad=0.2)
    return axes


def async_timeline_figure(timeline, seed: int | None = None, steps: tuple[int, int] = (2, 6)):
    """The figure ``figures/async_timeline.png``: :func:`plot_timeline` of one seed (default: the first) of
    every config of a sync/async recording's ``data/async_timeline.csv``."""
    seed = int(timeline["seed"].min()) if seed is None else seed
    runs = timeline[timeline["seed"] == seed]
    axes = plot_timeline({config: g for config, g in runs.groupby("config", sort=False)}, steps=steps)
    fig = axes[0].figure
    fig.suptitle(f"What the learner and the rollout worker do, steps {steps[0]}-{steps[1]} of seed {seed}", fontsize=10)
    fig.tight_layout()
    return fig


ASYNC_COLORS = {"sync": "tab:blue", "async-k1": "tab:orange", "async-k2": "tab:green"}


def async_figure(curve, test=None):
    """The figure ``figures/async_curves.png`` of ``benchmarks/async_curves.py``'s recording: the training
    reward per step of every run by config (``data/async_curves.csv``) and, with ``test``
    (``data/async_curves_test.csv``), the held-out success rate of the start and of each config's final
    policies, means over tasks (each task's rate averaged over the seeds) with 95 % bootstrap intervals."""
    import matplotlib.pyplot as plt

    from .train.evaluate import bootstrap_mean

    fig, (ax, ax1) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.4, 1]})
    for config, g in curve.groupby("config", sort=False):
        plot_training_reward(g, ax=ax, label=f"{config}:", color=ASYNC_COLORS.get(config))
    series = {config: tuple(g.sort_values(["seed", "step"])["reward_mean"].fillna(-1))
              for config, g in curve.groupby("config", sort=False)}
    same = [f"{a} = {b}" for i, (a, x) in enumerate(series.items()) for b, y in list(series.items())[i + 1:] if x == y]
    ax.set_title("training reward per step (data/async_curves.csv)" + (f"; identical: {', '.join(same)}" if same else ""),
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    if test is not None:
        configs = list(dict.fromkeys(test["config"]))
        start = test.groupby("task")["start_rate"].first()
        m, lo, hi = bootstrap_mean(start)
        ax1.errorbar([0], [m], yerr=[[m - lo], [hi - m]], fmt="o", color="black", capsize=4, label="start")
        for i, config in enumerate(configs):
            per_task = test[test["config"] == config].groupby("task")[["start_rate", "end_rate"]].mean()
            m, lo, hi = bootstrap_mean(per_task["end_rate"])
            gain, glo, ghi = bootstrap_mean(per_task["end_rate"] - per_task["start_rate"])
            ax1.errorbar([i + 1], [m], yerr=[[m - lo], [hi - m]], fmt="o", capsize=4,
                         color=ASYNC_COLORS.get(config), label=f"{config}: gain {gain:+.3f} [{glo:+.3f}, {ghi:+.3f}]")
        ax1.set_xticks(range(len(configs) + 1), ["start", *configs])
        ax1.set_xlim(-0.5, len(configs) + 0.5)
        ax1.set_ylabel("held-out success rate")
        tries = int(test["end_tries"].iloc[0]) if "end_tries" in test else "?"
        ax1.set_title(f"held-out test, {test['task'].nunique()} tasks x {tries} per seed", fontsize=10)
        ax1.legend(fontsize=7, loc="upper left")
        ax1.grid(alpha=0.3)
    fig.suptitle("Synchronous against asynchronous rollouts from the shipped start, tiny-cpu preset, 2 CPU cores",
                 fontsize=11)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def plot_peak_vs_length(results, paper=None, cap_gib: float | None = 80.0, ax=None, title: str | None = None):
    """Peak memory against trajectory length, one line per case (attention x log-probs x MLP;
    dashed: recorded), out-of-memory marked with an x above the ``cap_gib`` line at the length where
    it happened, and the paper's points (``paper``: rows of ``load_paper_claims`` with
    ``quantity == 'peak_vram'``; its OOM as a labelled arrow). Returns the axes."""
    import matplotlib.pyplot as plt

    from .bench.results import case_label, pd_numeric

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 5.5))
    top = cap_gib or 80.0
    oom_y = top * 1.06
    if results is not None and len(results):
        results = results[results["tokens"].notna()]
        top = max(top, float(pd_numeric(results["peak_gib"]).max() if len(results) else 0.0))
        oom_y = top * 1.06
        drawn: dict[tuple, str] = {}  # the points of each line drawn so far -> its label
        for label, grp in results.groupby(results.apply(case_label, axis=1), sort=True):
            grp = grp.sort_values("tokens")
            ok = grp[grp["status"] == "ok"]
            style = "--" if "(recorded)" in label else "-"
            points = tuple(zip(ok["tokens"].astype(float), pd_numeric(ok["peak_gib"]).round(3)))
            if points and points in drawn:
                # the same peaks as a line drawn already, which would hide this one: hollow diamonds
                # around its markers, and the legend says so
                (line,) = ax.plot(ok["tokens"], ok["peak_gib"], style, lw=0.8, marker="D", ms=8, mfc="none",
                                  label=f"{label} (= {drawn[points]})")
            else:
                (line,) = ax.plot(ok["tokens"], ok["peak_gib"], style, marker="o", ms=4, label=label)
                drawn.setdefault(points, label)
            oom = grp[grp["status"] == "oom"]
            if len(oom):
                ax.plot(oom["tokens"], [oom_y] * len(oom), "x", ms=10, mew=2, color=line.get_color())
    if paper is not None and len(paper):
        vram = paper[paper["quantity"] == "peak_vram"]
        for _, p in vram[vram["value"].notna()].iterrows():
            standard = "standard" in str(p["setting"])
            ax.plot(p["tokens"], p["value"], "s" if standard else "*", ms=11, color="black",
                    mfc="none" if standard else "black", label=f"paper: {p['setting']} at {int(p['tokens'])}")
        for _, p in vram[vram["value"].isna()].iterrows():
            ax.annotate(f"paper: {p['setting']} OOM", (p["tokens"], oom_y), xytext=(p["tokens"], oom_y * 0.9),
                        ha="center", fontsize=8, arrowprops={"arrowstyle": "->"})
    if cap_gib:
        ax.axhline(cap_gib, color="red", lw=1, ls=":", label=f"{cap_gib:g} GiB (an 80 GB card)")
    ax.plot([], [], "x", color="gray", mew=2, label="out of memory")
    ax.set_ylim(0, oom_y * 1.08)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("trajectory length (tokens)")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(title or "Peak memory of one GRPO step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return ax


def plot_cpu_step_memory(results, ax=None):
    """CPU rows: memory the step adds on top of the built process (peak RSS - RSS before the step)
    against trajectory length, one line per case."""
    import matplotlib.pyplot as plt

    from .bench.results import pd_numeric

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    cpu = results[(results["memory_metric"] == "cpu_peak_rss") & (results["status"] == "ok")].copy()
    cpu["step_gib"] = pd_numeric(cpu["peak_gib"]) - pd_numeric(cpu["base_gib"])
    colors = {"eager": "tab:red", "sdpa": "tab:blue", "flex": "tab:green", "sinkflex": "tab:purple"}
    for (attention, logprobs, mlp), grp in cpu.groupby(["attention", "logprobs", "mlp"], sort=True):
        grp = grp.sort_values("tokens")
        # colour: attention; line: log-probs; marker: MLP
        ax.plot(grp["tokens"], grp["step_gib"] * 1024, color=colors.get(attention, "gray"),
                ls="-" if logprobs == "full" else "--", marker="o" if mlp == "plain" else "s", ms=5,
                mfc="none" if mlp == "tiled" else None,
                label=f"{attention} · {logprobs} logprobs · {mlp} mlp")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("trajectory length (tokens)")
    ax.set_ylabel("memory added by the step (MiB, peak RSS)")
    preset = cpu["preset"].iloc[0] if len(cpu) else "tiny"
    ax.set_title(f"One GRPO step on CPU, preset {preset}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def regenerate_figures(data: Path | None = None, figures: Path | None = None):
    """Remake every figure that is drawn from ``data/`` CSVs; returns a table of
    (figure, made_from, status). Missing inputs are reported, not raised."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import pandas as pd

    from .bench.results import load_paper_claims, load_vram_results, step_rows
    from .paths import data_dir, figures_dir

    data = Path(data) if data else data_dir()
    figures = Path(figures) if figures else figures_dir()
    figures.mkdir(parents=True, exist_ok=True)
    done = []

    results = load_vram_results(data)
    paper = load_paper_claims(data)
    gpu = step_rows(results) if len(results) else results
    gpu = gpu[gpu["memory_metric"].astype(str).str.startswith("cuda") | (gpu["status"] != "ok")] if len(gpu) else gpu
    gpu = gpu[gpu["device"].astype(str) == "cuda"] if len(gpu) else gpu
    if len(gpu):
        fig, ax = plt.subplots(figsize=(11, 5.5))
        plot_peak_vs_length(gpu, paper=paper, cap_gib=80.0, ax=ax,
                            title="Peak GPU memory of one GRPO step, Qwen2.5-7B shape, LoRA r=16")
        fig.tight_layout()
        fig.savefig(figures / "vram_vs_length.png", dpi=120)
        plt.close(fig)
        done.append(("vram_vs_length.png", ", ".join(sorted(set(gpu["file"]))), "regenerated"))
    else:
        done.append(("vram_vs_length.png", "data/vram_*.csv (GPU rows)", "skipped: no GPU rows in data/"))

    cpu_path = data / "vram_cpu.csv"
    if cpu_path.exists() and len(results) and (results["memory_metric"] == "cpu_peak_rss").any():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        plot_cpu_step_memory(results[results["file"] == "vram_cpu.csv"], ax=ax)
        fig.tight_layout()
        fig.savefig(figures / "vram_cpu.png", dpi=120)
        plt.close(fig)
        done.append(("vram_cpu.png", "vram_cpu.csv", "regenerated"))
    else:
        done.append(("vram_cpu.png", "vram_cpu.csv", "skipped: not in data/ yet (notebook 06, default mode)"))

    att = [p for p in sorted(data.glob("attention_*.csv"))]
    att_frames = []
    for path in att:
        df = pd.read_csv(path)
        if {"case", "tokens", "ms"} <= set(df.columns):
            if "device" in df:  # timings of the GPU machine, not CPU exactness checks
                df = df[df["device"].astype(str) == "cuda"]
            if len(df):
                att_frames.append(df.assign(file=path.name))
    if att_frames:
        df = pd.concat(att_frames, ignore_index=True)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (case, fname), grp in df.groupby(["case", "file"], sort=True):
            grp = grp.sort_values("tokens")
            ax.plot(grp["tokens"], grp["ms"], marker="o", label=f"{case} ({fname})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("tokens")
        ax.set_ylabel("attention forward + backward (ms)")
        ax.set_title("Attention alone, bf16, 28 heads, head dim 128")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(figures / "attention_time.png", dpi=120)
        plt.close(fig)
        done.append(("attention_time.png", ", ".join(sorted(set(df["file"]))), "regenerated"))
    else:
        done.append(("attention_time.png", "data/attention_*.csv", "skipped: not in data/ yet"))

    def from_tables(name: str, make, table: str, extra: str | None, recorded_by: str) -> None:
        """Figure ``name`` = ``make(table, extra table or None)`` from data/ CSVs, or a skip naming the script."""
        main, more = data / table, data / extra if extra else None
        if not main.exists():
            done.append((name, table, f"skipped: not in data/ yet ({recorded_by})"))
            return
        has_more = more is not None and more.exists()
        fig = make(pd.read_csv(main), pd.read_csv(more) if has_more else None)
        fig.savefig(figures / name, dpi=120)
        plt.close(fig)
        done.append((name, table + (f", {extra}" if has_more else ""), "regenerated"))

    # The same figure as notebook 05's (which may add a run of one's own).
    from_tables("reward_curve.png", reward_figure, "reward_curve.csv", "reward_curve_test.csv",
                "benchmarks/reproduce_curve.py")
    from_tables("async_curves.png", async_figure, "async_curves.csv", "async_curves_test.csv",
                "benchmarks/async_curves.py")
    from_tables("async_timeline.png", lambda timeline, _: async_timeline_figure(timeline), "async_timeline.csv", None,
                "benchmarks/async_curves.py")

    baselines = data / "01_env_baselines.csv"
    if baselines.exists():
        table = pd.read_csv(baselines)
        envs = list(dict.fromkeys(table["env"]))
        ks = [c for c in table.columns if c.startswith("pass^")]
        fig, axes = plt.subplots(1, len(envs), figsize=(4.5 * len(envs), 3.2), sharey=True, squeeze=False)
        styles = {"oracle": ("o", "-", 8), "random": ("x", "--", 10), "do-nothing": ("s", ":", 5)}
        for ax, env_id in zip(axes[0], envs):
            for _, r in table[table["env"] == env_id].iterrows():
                marker, line, size = styles.get(r["agent"], ("^", "-", 6))
                ax.plot(range(1, len(ks) + 1), [r[c] for c in ks], marker=marker, linestyle=line, markersize=size,
                        label=f"{r['agent']} (mean reward {r['mean_reward']:.2f})")
            ax.set_title(f"{env_id} (test split)")
            ax.set_xlabel("k")
            ax.set_xticks(range(1, len(ks) + 1))
            ax.legend(loc="center right", fontsize=8)
        axes[0][0].set_ylabel("pass^k")
        axes[0][0].set_ylim(-0.05, 1.05)
        fig.tight_layout()
        fig.savefig(figures / "01_env_baselines.png", dpi=120)
        plt.close(fig)
        done.append(("01_env_baselines.png", "01_env_baselines.csv", "regenerated"))
    else:
        done.append(("01_env_baselines.png", "01_env_baselines.csv", "skipped: not in data/ yet (notebook 01)"))
    return pd.DataFrame(done, columns=["figure", "made_from", "status"])

