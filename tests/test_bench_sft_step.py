"""benchmarks/bench_sft_step.py: one SFT step in float32 and with bf16, on real oracle episodes."""

from __future__ import annotations

import argparse
import re

import pytest
from benchmark_scripts import load_benchmark


def test_shapes_are_checked_and_each_shape_prints_both_precisions(capsys):
    script = load_benchmark("bench_sft_step")
    assert script.shape_of("256x6") == (256, 6)
    for bad in ("256", "100x4", "256x0", "wide"):
        with pytest.raises(argparse.ArgumentTypeError):
            script.shape_of(bad)
    with pytest.raises(SystemExit):
        script.main(["--repeats", "0"])
    assert script.main(["--shapes", "64x1", "--repeats", "1", "--tasks", "2", "--threads", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.match(r"64x1 \(.*\): float32 (\S+) s .* bf16 (\S+) s .* x(\S+); first loss (\S+) vs (\S+) \(gap (\S+)\)",
                 line)
    assert m, line
    fp32, bf16, speedup, loss32, loss16, gap = map(float, m.groups())
    assert speedup == pytest.approx(fp32 / bf16, rel=0.05)
    assert gap == pytest.approx(abs(loss32 - loss16), abs=1e-4) and gap < 0.05  # the same model, rounded
