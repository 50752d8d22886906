# %% [markdown]
# # Solutions · 06 The VRAM comparison
#
# Exercise 1 measures four GRPO steps of the lesson's tiny model on this machine's CPU, each in its own
# process (under a minute on a laptop CPU; less in smoke mode), writing its rows under `build/`.
# Exercise 2 reads the GPU measurements recorded in `data/`. Try the exercises in the lesson first.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")
import pandas as pd

from sinkflex_core import bench
from sinkflex_core.notebooks import resolve_smoke
from sinkflex_core.paths import build_dir

smoke = resolve_smoke(False)
pd.set_option("display.width", 160)

# %% [markdown]
# ## Exercise 1 · Full logits against memory-light log-probs, at two lengths
#
# The lesson's harness with `attentions=["sdpa"]`, `logprobs=["full", "chunked"]`, `mlps=["plain"]` and two
# trajectory lengths: what each step adds to the process, and how that grows with the length. Compare the
# growth with one float32 copy of the `(L, V)` logits, `L x 16,384 x 4` bytes for the tiny model.

# %%
short, long = (256, 512) if smoke else (512, 2048)
cases = bench.plan(["sdpa"], ["full", "chunked"], ["plain"], [short, long])
settings = bench.Settings(preset="tiny", device="cpu", seed=0)
out = build_dir() / "exercises" / "06_logprob_paths.csv"
bench.run_cases(cases, settings, out)
rows = pd.read_csv(out)
assert rows["status"].eq("ok").all(), rows[["case", "status", "note"]]
rows["step_adds_mib"] = (rows["peak_gib"] - rows["base_gib"]) * 1024
adds = rows.pivot(index="tokens", columns="logprobs", values="step_adds_mib")
vocab = int(rows["vocab"].iloc[0])
print(adds.round(1).to_string())
print(f"growth from {short} to {long} tokens, MiB: full {adds['full'][long] - adds['full'][short]:.0f}, "
      f"chunked {adds['chunked'][long] - adds['chunked'][short]:.0f}; one (L, V) float32 copy grows by "
      f"{(long - short) * vocab * 4 / 2**20:.0f}")

# %% [markdown]
# With full logits the step's memory grows by a few `(L, V)` copies as the trajectory lengthens (the
# logits, their `log_softmax`, and their gradient); with the chunked path it grows by far less, since only one
# chunk of logits exists at a time. On the CPU these are peaks of resident memory, measured once: expect
# tens of MiB of noise, and rerun a case if a number looks odd. At a real vocabulary (152,064 for Qwen2.5)
# and 8,192 tokens, one copy is 4.6 GiB, which is where most of the paper's saving comes from.

# %% [markdown]
# ## Exercise 2 · Memory against length on the recorded GPU data
#
# From `bench.step_rows(bench.load_vram_results())`, the GPU rows: per case family, the memory each extra
# 1,000 tokens costs (between its two longest lengths that ran) and the longest length that ran.

# %%
gpu = bench.step_rows(bench.load_vram_results())
gpu = gpu[(gpu["device"].astype(str) == "cuda") & gpu["tokens"].notna()]
summary = []
for (attention, logprobs, mlp), grp in gpu.groupby(["attention", "logprobs", "mlp"]):
    ok = grp[grp["status"] == "ok"].sort_values("tokens")
    if len(ok) < 2:
        continue
    a, b = ok.iloc[-2], ok.iloc[-1]
    summary.append({"case": f"{attention}/{logprobs}/{mlp}",
                    "GiB per 1,000 tokens": round(1000 * (b["peak_gib"] - a["peak_gib"]) / (b["tokens"] - a["tokens"]), 2),
                    "longest that ran": int(b["tokens"]), "its peak GiB": b["peak_gib"],
                    "out of memory at": ", ".join(str(int(t)) for t in grp[grp["status"] == "oom"]["tokens"]) or "-"})
summary = pd.DataFrame(summary).sort_values("GiB per 1,000 tokens", ascending=False)
print(summary.to_string(index=False))
assert summary["GiB per 1,000 tokens"].iloc[0] > summary["GiB per 1,000 tokens"].iloc[-1]

# %% [markdown]
# Eager attention is the steepest and the first out of memory: it builds the `L x L` scores of every head.
# SDPA with full logits still pays for the `(L, V)` logits, so it grows by gigabytes per thousand tokens;
# the chunked log-probs divide that slope several times, and tiling the MLP over sequence slices lowers it
# again, which is how a 7B-shaped step reaches 131,072 tokens on one GPU. The weights and optimiser state
# are the constant part under every line; what differs between the methods is the slope.
