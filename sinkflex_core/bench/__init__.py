"""Benchmarks: ``sinkflex bench vram`` (peak memory and time of the trainer's GRPO step, case by case:
:mod:`.step` runs one case, :mod:`.vram` runs many, each in its own process, into ``data/vram_*.csv``)
and ``sinkflex bench results`` (:mod:`.results`: the paper's claims beside our measurements). The
figures drawn from these CSVs are in :mod:`sinkflex_core.plots`."""

from __future__ import annotations

import sys

from ..plots import plot_cpu_step_memory, plot_peak_vs_length, regenerate_figures
from .results import (
    RESULTS_BEGIN,
    RESULTS_END,
    case_label,
    load_paper_claims,
    load_vram_results,
    paper_vs_ours,
    ratio_table,
    readme_with_results,
    results_main,
    results_markdown,
    step_rows,
    targets_report,
)
from .step import (
    ATTENTIONS,
    COLUMNS,
    GIB,
    LOGPROBS,
    MLPS,
    RESULT_MARK,
    STATUSES,
    Case,
    Settings,
    build_policy,
    grpo_step,
    plan,
    run_case,
    step_batch,
    train_config,
)
from .vram import describe_row, gpu_slug, row_for, row_provenance, run_case_subprocess, run_cases, vram_main

__all__ = [
    "ATTENTIONS", "COLUMNS", "GIB", "LOGPROBS", "MLPS", "RESULTS_BEGIN", "RESULTS_END", "RESULT_MARK",
    "STATUSES", "Case", "Settings", "build_policy", "case_label", "describe_row",
    "gpu_slug", "grpo_step", "load_paper_claims", "load_vram_results", "main", "paper_vs_ours", "plan",
    "plot_cpu_step_memory", "plot_peak_vs_length", "ratio_table", "readme_with_results",
    "regenerate_figures", "results_main", "results_markdown", "row_for", "row_provenance", "run_case",
    "run_case_subprocess", "run_cases", "step_batch", "step_rows", "targets_report", "train_config", "vram_main",
]


def main(argv: list[str] | None = None) -> int:
    """``sinkflex bench <what> ...``; ``what`` is ``vram`` or ``results``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_case":  # the per-case child process
        from .vram import _child_main

        return _child_main(argv[1])
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: sinkflex bench vram [options]      (sinkflex bench vram --help for the options)\n"
              "       sinkflex bench results [--readme README.md]   (the paper's claims beside ours)")
        return 0 if argv else 2
    if argv[0] == "results":
        return results_main(argv[1:])
    if argv[0] != "vram":
        print(f"sinkflex bench: unknown command {argv[0]!r}; available: vram, results", file=sys.stderr)
        return 2
    return vram_main(argv[1:])
