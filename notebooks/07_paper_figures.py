# %% [markdown]
# # 07 · Paper figures: every figure remade from data/, and the paper's claims beside ours
#
# Regenerates every figure in `figures/` that is drawn from the CSV files in `data/` (peak memory against trajectory length, the CPU step memory, attention timings, the reward curve, synchronous against asynchronous rollouts and their timeline), skipping with a message those whose data is not there yet, and prints the side-by-side table: the paper's claim, our measurement, the hardware of each, and the gap.
#
# Needs: CPU only, reads `data/` and writes `figures/`. Time: a few seconds (smoke and default mode alike).

# %% tags=["parameters"]
smoke = False

# %%
from sinkflex_core.notebooks import resolve_smoke

smoke = resolve_smoke(smoke)

# %%
import pandas as pd

from sinkflex_core import bench
from sinkflex_core.paths import data_dir, figures_dir

pd.set_option("display.max_colwidth", 80)
pd.set_option("display.width", 200)
print("data files:", ", ".join(sorted(p.name for p in data_dir().glob("*.csv"))))

# %% [markdown]
# ## The paper's claims
#
# `data/paper_claims.csv`: each claim, as the paper states it, and how our matching measurement is found in `data/` (the file, a row filter, the column).

# %%
claims = bench.load_paper_claims()
print(claims[["claim_id", "setting", "tokens", "value", "unit", "hardware"]].to_string(index=False))

# %% [markdown]
# Two of the claims are derived from the others: the VRAM reduction at 4,096 tokens and the reward
# gained in training. Recomputed from the raw values, to the precision the paper prints:

# %%
# NBVAL_CHECK_OUTPUT
raw = claims.set_index("claim_id")["value"]
derived = {
    "vram_reduction_4k": ("(SINKFLEX - standard) / standard, %",
                          100 * (raw["vram_sinkflex_4k"] - raw["vram_standard_4k"]) / raw["vram_standard_4k"], 1),
    "reward_gain": ("end - start", raw["reward_end"] - raw["reward_start"], 2),
}
for claim_id, (how, value, digits) in derived.items():
    stated = raw[claim_id]
    print(f"{claim_id:18s} {how:38s} recomputed {value:+.{digits + 2}f} -> {value:+.{digits}f}, "
          f"stated {stated:+.{digits}f}: {'agrees' if round(value, digits) == round(stated, digits) else 'DIFFERS'}")
    assert round(value, digits) == round(stated, digits), claim_id

# %% [markdown]
# ## Figures

# %%
made = bench.regenerate_figures()
made

# %%
from IPython.display import Image, display

for _, row in made[made["status"] == "regenerated"].iterrows():
    print(row["figure"])
    display(Image(filename=str(figures_dir() / row["figure"]), width=640))

# %% [markdown]
# ## Paper claim, our measurement, hardware, gap
#
# The paper reports memory in "GB"; ours is GiB (2^30 bytes). Where the harness's own GPU run (`data/vram_h200.csv`) is missing, the memory rows fall back to the measurements recorded in `data/vram_recorded_h200.csv` (HF's `labels=` loss, uncapped H200), and the SINKFLEX rows say "not measured yet". The reward gain is the end minus the start, each a mean over the recorded seeds. The README's "Results so far" table is this one, written by `sinkflex bench results --readme README.md`.

# %%
# NBVAL_CHECK_OUTPUT
comparison = bench.paper_vs_ours()
print(comparison.to_string(index=False))

# %% [markdown]
# ## Our GPU targets

# %%
# NBVAL_CHECK_OUTPUT
print(bench.targets_report(bench.load_vram_results()).to_string(index=False))

# %% [markdown]
# ## Exercises
#
# Change one thing, run the cells again, and look for what each exercise names.
#
# 1. **One seed.** Copy `data/` to a folder under `build/`, keep only seed 0 in the copy's
#    `reward_curve.csv`, and call `bench.regenerate_figures(copy, figures_folder)` with a figures folder
#    under `build/` too (the repository's figures stay as they are). What does the reward figure no longer
#    show, and how large is the spread between the recorded seeds compared with the gain of training?
# 2. **A slice of the rows.** In another copy keep only the rows of `vram_recorded_h200.csv` with
#    `logprobs == "full"` and regenerate. Which lines are left in `vram_vs_length.png`, and how far do they
#    reach?
# 3. **A missing input.** Delete `attention_recorded_h200.csv` from a copy and regenerate. What does the
#    returned table say, and which figures are still made?
#
# Solutions: [`solutions/07_paper_figures.py`](solutions/07_paper_figures.py), one cell per exercise that runs and prints what to look for (JupyterLab with jupytext opens it as a notebook; or `jupytext --to ipynb notebooks/solutions/07_paper_figures.py`).
