"""Shared test set-up: notebooks (run by nbval in kernels that inherit this environment) and tests
run in smoke mode, headless, with a bounded thread count on small CI machines."""

import os

os.environ.setdefault("SINKFLEX_SMOKE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The lessons' solutions are scripts (tests/test_solutions.py runs them); a copy a student converted to
# .ipynb is theirs, not a stored notebook for nbval to check.
collect_ignore_glob = ["notebooks/solutions/*.ipynb"]
