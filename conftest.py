"""Shared test set-up: notebooks (run by nbval in kernels that inherit this environment) and tests
run in smoke mode, headless, with a bounded thread count on small CI machines."""

import os

import pytest

os.environ.setdefault("SINKFLEX_SMOKE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The lessons' solutions are scripts (tests/test_solutions.py runs them); a copy a student converted to
# .ipynb is theirs, not a stored notebook for nbval to check.
collect_ignore_glob = ["notebooks/solutions/*.ipynb"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The project tokenizer saved once per test session, so that trainers and subprocesses load it in
    milliseconds instead of training it."""
    from sinkflex_core.models import get_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    get_tokenizer().save_pretrained(path)
    return str(path)
