# %% [markdown]
# # 00 · Setup: check this machine and meet the tutorials
#
# Checks that the Python environment has what the tutorials need (Python, torch, transformers,
# gymnasium), says which device is here (CPU or which GPU), whether FlexAttention can train on it and
# whether vLLM is importable, then lists the tutorials in order with their parameters.
#
# **Needs:** any machine with the project installed (`make setup`, or `make reproduce` / `make test`
# which set up `.venv` themselves). **Takes:** a few seconds.

# %% tags=["parameters"]
smoke = False  # True: the quick mode the test suite uses (this notebook is quick either way)

# %%
from sinkflex_core.notebooks import resolve_smoke

smoke = resolve_smoke(smoke)

# %% [markdown]
# ## What is installed, and what this machine can do
#
# `environment_report()` gathers versions and probes the device. On a CPU, FlexAttention runs forward
# only (no backward), so training there uses the library's exact CPU paths of the same attention
# (PyTorch's fused attention kernel under the sink mask, or a chunked pure-PyTorch path when the mask
# would be large); on a CUDA GPU the compiled FlexAttention kernels do both.

# %%
from sinkflex_core.system import environment_report, print_report

report = environment_report()
print_report(report)

# %% [markdown]
# The minimum versions the library is written for. A failed line here explains most errors later.

# %%
# NBVAL_CHECK_OUTPUT
import sys

import gymnasium
import torch
import transformers
from packaging.version import Version

checks = {
    "Python >= 3.10": sys.version_info >= (3, 10),
    "torch >= 2.6 (FlexAttention with log-sum-exp)": Version(torch.__version__.split("+")[0]) >= Version("2.6"),
    "transformers 5.x": Version(transformers.__version__).major == 5,
    "gymnasium >= 1.0": Version(gymnasium.__version__) >= Version("1.0"),
}
for name, ok in checks.items():
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
assert all(checks.values()), "the environment is missing something: see the FAIL lines above"

# %% [markdown]
# ## The tutorials
#
# | notebook | what it teaches | needs |
# |---|---|---|
# | `00_setup` | this check | anything |
# | `01_gym_wrapper` | one Gymnasium interface for a simulated retail store, an HTTP tool server and a SQL database; an oracle episode turn by turn; how the reward is computed | CPU, about 30 s |
# | `02_grpo_loss` | group-relative advantages, the clipped objective, KL estimators, loss aggregation, memory-light log-probs | CPU, seconds |
# | `03_sink_flex_attention` | sink tokens + sliding window masks, the zero-value sink, per-layer sink estimation, exactness | CPU (GPU for the compiled kernels and timings) |
# | `04_rollouts` | multi-turn, token-in/token-out rollouts of a group of 8 | CPU, 2 to 3 minutes |
# | `05_grpo_training` | SFT then GRPO of a tiny policy on the retail world; the reward curve | CPU: about a minute (smoke); about 11 minutes from the shipped start (10 of them training); `preset="paper-8xh100"` prints the 8-GPU command |
# | `06_vram_comparison` | the paper's VRAM comparison, measured | GPU for new measurements; on CPU it plots the recorded ones |
# | `07_paper_figures` | every figure regenerated from `data/`, and the paper-vs-ours table | CPU |
#
# Below: the notebooks actually present in this checkout, with the parameters each accepts
# (read from its cell tagged `parameters`).

# %%
from sinkflex_core.notebooks import list_notebooks

for nb in list_notebooks():
    params = ", ".join(f"{k}={v!r}" for k, v in nb.parameters.items())
    print(f"{nb.name:<28} {nb.title}")
    print(f"{'':<28} parameters: {params or '(none)'}")

# %% [markdown]
# ## Running a notebook with other parameters
#
# Every notebook has a cell tagged `parameters`; papermill replaces its values. From the repository root:
#
# ```bash
# sinkflex reproduce                        # all notebooks, defaults (CPU, tiny scale); = make reproduce
# sinkflex reproduce --only 05 -p seed=1    # one notebook, one parameter changed
# papermill notebooks/05_grpo_training.ipynb build/05_paper.ipynb -p preset paper-8xh100
# sinkflex notebooks list                   # the list above
# ```
#
# Executed copies go to `build/notebooks/`, figures to `figures/`, measured results to `data/`.
# `smoke=True` runs any notebook in about a minute or less (the test suite does this).

# %% [markdown]
# ## Exercises
#
# Change one thing, run the cells again, and look for what each exercise names.
#
# 1. **FlexAttention here, forward and backward.** The report's `flex_attention` line comes from a 16-token
#    probe. In a new cell, make random `q`, `k`, `v` of shape `(1, 2, 256, 32)` and run
#    `attention.sink_attention(q, k, v, n_sink=4, window=64, backend="flex")` (`from sinkflex_core import
#    attention`), then the same with `backend="chunked"`; compare each with `attention.reference_attention`
#    and call `.backward()` through each. Which path can train on this device, and how close are both to the
#    formula?
# 2. **Threads.** `cpu_threads` is the number of threads torch computes with. Time a 1024 x 1024 matrix
#    product after `torch.set_num_threads(1)`, then after `torch.set_num_threads(os.cpu_count())`. How much
#    faster is it with every core, and what changes when the machine's cores are busy with other work?
# 3. **Smoke mode.** Set `os.environ["SINKFLEX_SMOKE"] = "1"` and run the `resolve_smoke` cell again with the
#    `smoke` parameter still `False`, then print `sinkflex_core.paths.figures_dir()`. Which wins, the
#    parameter or the environment, why does the test suite need it that way, and where do the figures of a
#    smoke run go?
#
# Solutions: [`solutions/00_setup.py`](solutions/00_setup.py), one cell per exercise that runs and prints what to look for (JupyterLab with jupytext opens it as a notebook; or `jupytext --to ipynb notebooks/solutions/00_setup.py`).
