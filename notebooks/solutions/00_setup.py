# %% [markdown]
# # Solutions · 00 Setup
#
# Run the cells in order; each prints what the exercise asks you to look for. Try the exercise in the
# lesson first. Takes a few seconds (plus the imports).

# %%
import os
import time
import warnings

import torch

from sinkflex_core import attention
from sinkflex_core.notebooks import resolve_smoke
from sinkflex_core.paths import SMOKE_ENV, data_dir, figures_dir, repo_root
from sinkflex_core.system import flex_attention_status

smoke = resolve_smoke(False)

# %% [markdown]
# ## Exercise 1 · FlexAttention on this device, forward and backward
#
# The report's `flex_attention` line comes from a 16-token probe. The same question on 256 tokens, with the
# sink-and-window mask of notebook 03 (4 sinks, a window of 64 keys): FlexAttention (`backend="flex"`) and
# the library's exact PyTorch path (`backend="chunked"`), each compared with the dense float64 formula, then
# a backward through each.

# %%
device = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 256, 32, generator=g).to(device) for _ in range(3))
ref = attention.reference_attention(q, k, v, n_sink=4, window=64)
works = {}
for backend in ("flex", "chunked"):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the uncompiled flex path warns that it is unfused
        out = attention.sink_attention(q, k, v, n_sink=4, window=64, backend=backend)
    err = float((out.double() - ref).abs().max())
    qg = q.clone().requires_grad_()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            attention.sink_attention(qg, k, v, n_sink=4, window=64, backend=backend).sum().backward()
        works[backend] = "forward and backward"
    except NotImplementedError as exc:
        works[backend] = f"forward only ({exc})"
    print(f"{backend:>8} on {device}: max |out - formula| = {err:.1e}; {works[backend]}")
    assert err < 1e-5
print("the report's probe says:", flex_attention_status())
assert works["chunked"] == "forward and backward"

# %% [markdown]
# Both paths compute the same attention as the formula, to float32 rounding. On a CPU FlexAttention has no
# backward, so it cannot train here; the chunked path, exact as well, does the forward and the backward.
# `backend="auto"` picks FlexAttention on a CUDA GPU, where its compiled kernels do both; on a CPU it picks
# a third exact path, `backend="fused"` (PyTorch's fused attention kernel under the sink mask), and the
# chunked one only where that mask would be large or the lse's gradient is asked for (notebook 03 compares
# all three).

# %% [markdown]
# ## Exercise 2 · Threads
#
# `cpu_threads` in the report is `torch.get_num_threads()`. The same matrix product with 1 thread and with
# one thread per core:

# %%
n = 512 if smoke else 1024
a, b = torch.randn(n, n), torch.randn(n, n)
default_threads = torch.get_num_threads()
seconds = {}
for threads in sorted({1, os.cpu_count() or 1}):
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    a @ b  # warm-up
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    seconds[threads] = (time.perf_counter() - t0) / 5
    print(f"{threads:>3} thread(s): {seconds[threads] * 1e3:7.1f} ms per {n} x {n} product")
torch.set_num_threads(default_threads)
print(f"cores: {os.cpu_count()}, threads torch uses by default here: {default_threads}")

# %% [markdown]
# On an idle machine the product runs up to about as many times faster as there are cores, never more; on a
# machine whose cores are busy with other work, more threads gain little, can even be slower, and slow the
# other work down. That is why a shared machine is better run with `OMP_NUM_THREADS=1`, and why the timings
# quoted in the lessons say how many cores, and how idle, the machine was.

# %% [markdown]
# ## Exercise 3 · Smoke mode
#
# `resolve_smoke(smoke)` with the parameter left at `False`, under both values of `SINKFLEX_SMOKE`, and where
# each mode writes its figures and results.

# %%
saved = os.environ.get(SMOKE_ENV)
try:
    for value in ("0", "1"):
        os.environ[SMOKE_ENV] = value
        print(f"SINKFLEX_SMOKE={value}: smoke = {resolve_smoke(False)}, "
              f"figures -> {figures_dir().relative_to(repo_root())}/, data -> {data_dir().relative_to(repo_root())}/")
    os.environ[SMOKE_ENV] = "1"
    assert resolve_smoke(False) and figures_dir() != repo_root() / "figures"
finally:
    if saved is None:
        os.environ.pop(SMOKE_ENV, None)
    else:
        os.environ[SMOKE_ENV] = saved

# %% [markdown]
# The environment variable wins over the parameter: the test suite cannot pass parameters to the notebooks
# that nbval runs, so it sets `SINKFLEX_SMOKE=1` and every notebook turns itself into its quick version
# (papermill's `-p smoke True` does the same for one run). A smoke run draws its figures in
# `build/smoke/figures/`, a scratch copy, and never rewrites the tracked `figures/`; the notebooks that
# record results in `data/` skip that in smoke mode, so `data/` only ever holds the numbers of default runs.
