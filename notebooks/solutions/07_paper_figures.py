# %% [markdown]
# # Solutions · 07 Paper figures
#
# Each exercise copies `data/` into `build/exercises/07_*`, changes the copy, and regenerates the figures
# from it into `build/` too: the repository's `data/` and `figures/` are never touched. A few seconds.
# Try the exercises in the lesson first.

# %%
import shutil

import pandas as pd
from IPython import get_ipython
from IPython.display import Image, display

from sinkflex_core import bench, train
from sinkflex_core.paths import build_dir, data_dir

pd.set_option("display.width", 200)


def data_copy(name: str):
    """A fresh copy of data/ under build/exercises/, and an empty folder for its figures."""
    root = build_dir() / "exercises" / name
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(data_dir(), root / "data")
    (root / "figures").mkdir()
    return root / "data", root / "figures"


def show(path):
    """The figure inline in Jupyter; its path when run as a script."""
    if get_ipython() is not None:
        display(Image(filename=str(path), width=640))
    else:
        print("figure:", path)


# %% [markdown]
# ## Exercise 1 · The reward curve from one seed
#
# Keep only seed 0 in the copy's `reward_curve.csv`, regenerate, and compare with the figure of all the
# recorded seeds. The recording holds 3 seeds of each attention (sink and full attention); each run's
# held-out test reward at the end is in `reward_curve_test.csv`, beside the gain of training.

# %%
data, figures = data_copy("07_one_seed")
curve = pd.read_csv(data / "reward_curve.csv")
print("recorded runs:", {a: sorted(g["seed"].unique().tolist()) for a, g in curve.groupby("attention", sort=False)})
gains = train.paired_gains(pd.read_csv(data / "reward_curve_test.csv"))
for attention, g in gains.groupby("attention", sort=False):
    runs, overall = g[g["seed"] != "all"], g[g["seed"] == "all"].iloc[0]
    print(f"{attention:>8}: test reward at the end of seeds {', '.join(map(str, runs['seed']))}: "
          f"{', '.join(f'{e:.3f}' for e in runs['end'])}; spread between seeds {runs['end'].max() - runs['end'].min():.3f}, "
          f"gain of training over the seeds {overall['gain']:+.3f}")
curve[curve["seed"] == curve["seed"].min()].to_csv(data / "reward_curve.csv", index=False)
assert pd.read_csv(data / "reward_curve.csv").groupby("attention")["seed"].nunique().eq(1).all()
made = bench.regenerate_figures(data, figures)
print(made[made["figure"] == "reward_curve.png"].to_string(index=False))
assert (figures / "reward_curve.png").exists()
show(figures / "reward_curve.png")

# %% [markdown]
# With one seed the training-reward panel draws one line per attention, that seed's, and no mean over
# seeds: nothing tells the reader how much of the rise is the method and how much that seed's luck. (The
# test panel is unchanged: it is drawn from `reward_curve_test.csv`, which the copy kept whole.) The seeds
# of one attention end apart by the spread printed above, as much as the whole gain of training at this
# scale or more, which is why the repository records several seeds and the figure draws every one of them
# beside their mean.

# %% [markdown]
# ## Exercise 2 · The memory figure from a slice of the rows
#
# Keep only the rows with `logprobs == "full"` in the copy's `vram_recorded_h200.csv`, regenerate the
# memory figure: which lines are left, and how far do they reach?

# %%
data, figures = data_copy("07_full_logits")
recorded = pd.read_csv(data / "vram_recorded_h200.csv")
recorded[recorded["logprobs"] != "chunked"].to_csv(data / "vram_recorded_h200.csv", index=False)
made = bench.regenerate_figures(data, figures)
print(made[made["figure"] == "vram_vs_length.png"].to_string(index=False))
show(figures / "vram_vs_length.png")
kept = pd.read_csv(data / "vram_recorded_h200.csv")
kept = kept[kept["tokens"].notna() & ~kept["case"].str.startswith("attention-only")]
print("lines left in the figure (longest length that ran):")
print(kept[kept["status"] == "ok"].groupby(["attention", "logprobs", "mlp"])["tokens"].max().astype(int).to_string())
assert set(kept["logprobs"]) == {"full"}

# %% [markdown]
# The figure keeps the lines of the full-logit cases only: eager, SDPA and flex attention with the
# `(L, V)` logits, none past 16,384 tokens (eager out of memory there), and the long lines of the chunked
# log-probs are gone. Every figure and table is a function of `data/`: to change what a figure shows,
# change (a copy of) the data, never the figure, and a reader can check the figure from the CSV beside it.

# %% [markdown]
# ## Exercise 3 · A missing input
#
# Delete the copy's `attention_recorded_h200.csv` and regenerate: what happens to the attention-time figure
# and to the others?

# %%
data, figures = data_copy("07_missing_input")
(data / "attention_recorded_h200.csv").unlink()
made = bench.regenerate_figures(data, figures)
print(made.to_string(index=False))
assert made.set_index("figure").loc["attention_time.png", "status"].startswith("skipped")
assert (made["status"] == "regenerated").sum() == len(made) - 1

# %% [markdown]
# The figure whose data is missing is skipped with a message saying what it needs, and every other figure
# is still made: a fresh clone, or a machine that has not run the GPU benchmarks yet, regenerates what its
# data allows instead of failing on the first gap.
