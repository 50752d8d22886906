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


def reward_figure(recorded=None, sft_recorded=None, live=None, baseline=None):
    """The figure ``figures/reward_curve.png`` (notebooks 05 and 07): the SFT start's validation reward
    per stage (``data/reward_curve_sft.csv``) beside GRPO's test reward for every recorded seed
    (``data/reward_curve.csv``), with the paper's start and end; ``live``, a curve table of a run of
    one's own, is added in its own colour, and ``baseline``, the recorded seeds of GRPO on all the
    training tasks (``data/reward_curve_all_tasks.csv``, recorded under reward version 1), in grey.
    Any of them may be None."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.4]})
    if sft_recorded is not None:
        x = "total_step" if "total_step" in sft_recorded else "step"
        for run, g in sft_recorded.groupby("run", sort=False):
            ax0.plot(g[x], g["val_reward"], marker="o", label=f"{run} (peak lr {g['peak_lr'].iloc[0]:g})")
    ax0.axhline(PAPER_REWARD_START, color="grey", ls=":", lw=1, label=f"wanted start: {PAPER_REWARD_START}")
    ax0.set_xlabel("SFT step")
    ax0.set_ylabel("mean reward, held-out training tasks")
    ax0.set_title("SFT start (data/reward_curve_sft.csv)", fontsize=10)
    ax0.grid(alpha=0.3)
    ax0.legend(fontsize=8)
    if baseline is not None:
        plot_reward_curves(baseline, ax=ax, label="all training tasks (reward v1):", color="tab:gray")
    if recorded is not None:
        plot_reward_curves(recorded, ax=ax, label="screened tasks:", color="tab:blue")
    if live is not None:
        plot_reward_curves(live, ax=ax, label="this run:", color="tab:orange")
    ax.axhline(PAPER_REWARD_START, color="grey", ls=":", lw=1, label=f"paper, start: {PAPER_REWARD_START}")
    ax.axhline(PAPER_REWARD_END, color="grey", ls="--", lw=1, label=f"paper, end: {PAPER_REWARD_END} (7B, 8 x H100)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean test reward")
    ax.grid(alpha=0.3)
    ax.set_title("GRPO: test reward (data/reward_curve.csv)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    n_params = f"{recorded['parameters'].iloc[0] / 1e6:.1f}M parameters, " \
        if recorded is not None and "parameters" in recorded else ""
    fig.suptitle(f"Retail store, tiny Qwen2 policy ({n_params}trained from scratch) on a 2-core CPU", fontsize=11)
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
        for label, grp in results.groupby(results.apply(case_label, axis=1), sort=True):
            grp = grp.sort_values("tokens")
            ok = grp[grp["status"] == "ok"]
            style = "--" if "(recorded)" in label else "-"
            (line,) = ax.plot(ok["tokens"], ok["peak_gib"], style, marker="o", ms=4, label=label)
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

    curve = data / "reward_curve.csv"
    if curve.exists():
        extra = {name: data / f"reward_curve_{name}.csv" for name in ("sft", "all_tasks")}
        extra = {name: pd.read_csv(path) for name, path in extra.items() if path.exists()}
        # The same figure as notebook 05's (which may add a run of one's own).
        fig = reward_figure(pd.read_csv(curve), extra.get("sft"), baseline=extra.get("all_tasks"))
        fig.savefig(figures / "reward_curve.png", dpi=120)
        plt.close(fig)
        done.append(("reward_curve.png", ", ".join(["reward_curve.csv"] + [f"reward_curve_{n}.csv" for n in extra]),
                     "regenerated"))
    else:
        done.append(("reward_curve.png", "reward_curve.csv", "skipped: not in data/ yet (benchmarks/reproduce_curve.py)"))

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

