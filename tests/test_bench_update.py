"""benchmarks/bench_update.py: its kernel paths run the same update (the same weights after it), and
bad arguments are refused before any work."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark

from sinkflex_core.attention.hf import _attention_modules
from sinkflex_core.paths import data_dir

START = data_dir() / "retail-tiny-start"


def test_kernel_paths_give_the_same_update(tmp_path):
    bench = load_benchmark("bench_update")
    from sinkflex_core.train import Trainer, resolve_config

    cfg = resolve_config("tiny-cpu", {"model": str(START), "out_dir": str(tmp_path / "run"), "tasks_per_step": 1,
                                      "group_size": 2, "num_minibatches": 1, "threads": 1, "progress": False,
                                      "tensorboard": False})
    trainer = Trainer(cfg)
    rows = bench.oracle_batch(trainer)
    assert rows["rewards"].tolist() == [0.0, 1.0]  # every group has a signal
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    logp, sums = {}, {}
    for path in ("sinkflex", "sinkflex-one-mask", "sinkflex-chunked"):
        bench.set_kernel(trainer, path, chunk=64)
        modules = _attention_modules(trainer.policy.lm)
        assert {m.sinkflex_chunk_size for m in modules} == {1 << 30 if path == "sinkflex-one-mask" else 64}
        assert {m.sinkflex_backend for m in modules} == {"chunked" if path == "sinkflex-chunked" else "auto"}
        logp[path] = trainer._frozen_logprobs(rows, "old")
        (seconds,), sums[path] = bench.time_updates(trainer, rows, repeats=1)
        assert seconds > 0 and sums[path]["updates"] == 1
        # each path starts from the same weights
        assert all(torch.equal(v, before[k]) for k, v in trainer.policy.state_dict().items())
    assert rows["input_ids"].shape[1] > 64  # more than one query block
    real = rows["loss_mask"].bool()
    for path in ("sinkflex-one-mask", "sinkflex-chunked"):
        assert (logp[path] - logp["sinkflex"])[real].abs().max() < 1e-4, path
        for key in ("loss", "pg_loss", "kl", "tokens"):
            assert sums[path][key] == pytest.approx(sums["sinkflex"][key], rel=1e-4, abs=1e-6), (path, key)
    assert sums["sinkflex"]["kl"] != 0 or sums["sinkflex"]["pg_loss"] != 0  # a real loss was compared


@pytest.mark.parametrize("args,message", [
    (["--policy", str(START), "--paths", "sinkflex,flash"], "unknown path"),
    (["--policy", "no/such/folder"], "no such folder"),
    (["--policy", str(START), "--repeats", "0"], "--repeats, --threads and --chunk must be >= 1"),
    (["--policy", str(START), "--threads", "0"], "--repeats, --threads and --chunk must be >= 1"),
    (["--policy", str(START), "--chunk", "0"], "--repeats, --threads and --chunk must be >= 1"),
    (["--policy", str(START), "--tasks", "-1"], "--tasks >= 0"),
    (["--policy", str(START), "--group-size", "1"], "--group-size 0 or >= 2"),
])
def test_bad_arguments_are_refused(args, message, capsys, monkeypatch):
    bench = load_benchmark("bench_update")
    from sinkflex_core import train

    # refused before any trainer is built (they failed only after it and the batch)
    monkeypatch.setattr(train, "Trainer", lambda *a, **k: pytest.fail("a trainer was built"))
    with pytest.raises(SystemExit):
        bench.main(args)
    assert message in capsys.readouterr().err
