"""The VRAM harness: the same GRPO step for every case (same loss and gradients whatever the
attention kernel, log-prob path or MLP tiling), measurements and provenance in the CSV, each case in
its own process, out-of-memory recorded and not fatal, and the paper-vs-ours table."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from sinkflex_core import bench, presets
from sinkflex_core.bench import Case, Settings

SMALL = Settings(preset="tiny", device="cpu", dtype="fp32", chunk_size=64, slice_tokens=64, seed=0)


def _loss_and_grads(case: Case, settings: Settings):
    """The GRPO loss of one step and the gradients of the trainable parameters (no optimizer step)."""
    settings = settings.resolved()
    policy, cfg = bench.build_policy(case, settings)
    # LoRA starts with B = 0 (policy == reference); move away from it so that ratio and KL matter.
    torch.manual_seed(5)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    batch = bench.step_batch(case.tokens, presets.shape(settings.preset).vocab, "cpu", 0)

    class NoStep:  # measure the gradients before they are applied
        grads: dict = {}

        def step(self):
            NoStep.grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

        def zero_grad(self, set_to_none=True):
            policy.zero_grad(set_to_none=set_to_none)

    class NoSchedule:
        def step(self):
            pass

    loss = bench.grpo_step(policy, NoStep(), NoSchedule(), batch, cfg)
    return loss, NoStep.grads


def test_the_harness_times_the_trainers_update(monkeypatch):
    """The step the harness measures is the trainer's own update: grpo_step goes through
    train.update.grpo_update (and so grpo.grpo_loss) on a policy that train.load_model built."""
    from sinkflex_core import grpo
    from sinkflex_core.train import update

    calls = {"update": 0, "loss": 0}
    real_update, real_loss = update.grpo_update, grpo.grpo_loss

    def counting_update(*args, **kwargs):
        calls["update"] += 1
        return real_update(*args, **kwargs)

    def counting_loss(*args, **kwargs):
        calls["loss"] += 1
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(update, "grpo_update", counting_update)
    monkeypatch.setattr(grpo, "grpo_loss", counting_loss)
    row = bench.run_case(Case("sdpa", "chunked", "plain", 64), SMALL)
    assert row["status"] == "ok", row
    assert calls == {"update": 1, "loss": 1}
    policy, cfg = bench.build_policy(Case("sdpa", "chunked", "plain", 64), SMALL)
    assert cfg.gradient_checkpointing and cfg.lora and cfg.logprob_chunk_size == SMALL.resolved().chunk_size
    assert policy.lm.base_model.model.model.gradient_checkpointing


@pytest.mark.slow
def test_same_step_for_every_case():
    # each of attention kernel, log-prob path and MLP tiling changed at least once against the first
    cases = [Case("eager", "full", "plain", 200), Case("sdpa", "full", "tiled", 200),
             Case("sdpa", "chunked", "plain", 200), Case("eager", "chunked", "tiled", 200)]
    ref_loss, ref_grads = _loss_and_grads(cases[0], SMALL)
    assert len(ref_grads) == 4 * 2 * 4  # 4 layers x (A, B) x (q, k, v, o)
    assert sum(float(g.abs().sum()) for g in ref_grads.values()) > 0
    for case in cases[1:]:
        loss, grads = _loss_and_grads(case, SMALL)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), case.name
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=2e-3, atol=2e-6, msg=f"{case.name} {name}")


def test_first_update_loss_is_minus_the_advantage():
    # At the first update the policy is the reference and the sampler: ratio 1, KL 0, so the
    # token-mean loss is -advantage = -1.
    row = bench.run_case(Case("sdpa", "full", "plain", 128), SMALL)
    assert row["status"] == "ok", row
    assert row["loss"] == pytest.approx(-1.0, abs=1e-6)
    assert row["memory_metric"] == "cpu_peak_rss"
    assert row["peak_gib"] >= row["base_gib"] > 0
    assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(128 / row["step_s"])


def test_sinkflex_case_trains_its_sinks():
    settings = Settings(preset="tiny", device="cpu", dtype="fp32", window=32, chunk_size=64, seed=0)
    loss, grads = _loss_and_grads(Case("sinkflex", "full", "plain", 150), settings)
    assert math.isfinite(loss), loss
    sink_grads = [g for n, g in grads.items() if "sink" in n]
    assert len(sink_grads) == 4  # one (H,) logit vector per layer, trained beside LoRA
    # The sink enters through the kernel's log-sum-exp: a path that drops its gradient leaves zeros.
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in sink_grads), sink_grads
    # Window attention with sinks is another model than full attention: the loss differs.
    full, _ = _loss_and_grads(Case("sdpa", "full", "plain", 150), settings)
    assert abs(loss - full) > 1e-6, (loss, full)


def test_plan_and_bad_input():
    cases = bench.plan(["sdpa", "eager"], ["full"], ["plain", "tiled"], [4096, 1024, 1024])
    assert [c.name for c in cases][:3] == ["sdpa/full/plain/1024", "sdpa/full/plain/4096", "sdpa/full/tiled/1024"]
    assert len(cases) == 2 * 2 * 2
    with pytest.raises(ValueError, match="unknown attention"):
        bench.plan(["flash"], ["full"], ["plain"], [1024])
    with pytest.raises(ValueError, match="tokens"):
        bench.plan(["sdpa"], ["full"], ["plain"], [1])
    with pytest.raises(ValueError, match="unknown preset"):
        Settings(preset="70b").resolved()
    with pytest.raises(SystemExit):
        bench.main(["vram", "--attention", "flash"])
    assert bench.main(["nope"]) == 2


def test_flex_is_unavailable_on_cpu():
    row = bench.run_case_subprocess(Case("flex", "full", "plain", 256), SMALL)
    assert row["status"] == "unavailable" and "backward on CPU" in row["note"]


@pytest.mark.slow
def test_cli_writes_rows_with_provenance(tmp_path, capsys):
    out = tmp_path / "vram_cpu.csv"
    rc = bench.main(["vram", "--attention", "sdpa", "flex", "--logprobs", "full", "--mlp", "plain",
                     "--tokens", "256", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["case"] for r in rows] == ["sdpa/full/plain/256", "flex/full/plain/256"]
    ok, flex = rows
    assert ok["status"] == "ok" and float(ok["peak_gib"]) > 0 and float(ok["step_s"]) > 0
    assert float(ok["loss"]) == pytest.approx(-1.0, abs=1e-5)
    assert flex["status"] == "unavailable"
    for col in ("gpu", "torch", "transformers", "peft", "date", "git_sha", "device", "source"):
        assert ok[col], col
    assert ok["torch"] == torch.__version__ and ok["gpu"].startswith("cpu") and ok["preset"] == "tiny"
    assert "sdpa/full/plain/256" in capsys.readouterr().out


@pytest.mark.slow
def test_out_of_memory_is_recorded_not_fatal(tmp_path):
    # The CPU cap limits the address space the step may add; 50 MiB cannot hold the 1,024 x 16,384
    # float32 logits (64 MiB), so the step fails to allocate, and the longer run is skipped.
    out = tmp_path / "oom.csv"
    rc = bench.main(["vram", "--attention", "sdpa", "--logprobs", "full", "--mlp", "plain", "--tokens", "1024",
                     "4096", "--device", "cpu", "--cap-gib", "0.05", "--out", str(out)])
    assert rc == 0
    first, second = list(csv.DictReader(open(out)))
    assert first["status"] == "oom" and "allocate" in first["note"].lower()
    assert float(first["peak_gib"]) > 0
    assert second["status"] == "skipped" and "1024" in second["note"]


@pytest.mark.slow
def test_a_timed_out_case_is_not_run_longer_and_no_case_runs_past_the_budget(tmp_path):
    common = ["vram", "--attention", "sdpa", "--logprobs", "chunked", "--mlp", "plain", "--tokens", "256", "512",
              "--device", "cpu"]
    # 2 s is less than a case's process takes to import torch: the first times out, the longer is not run
    out = tmp_path / "timeout.csv"
    assert bench.main([*common, "--timeout", "2", "--out", str(out)]) == 0
    first, second = list(csv.DictReader(open(out)))
    assert first["status"] == "timeout"
    assert second["status"] == "skipped" and "timed out at 256 tokens" in second["note"]
    # a 21 s budget: the first case gets at most what is left of it, the second (under 20 s left) none
    out = tmp_path / "budget.csv"
    assert bench.main([*common, "--timeout", "600", "--budget", "21", "--out", str(out)]) == 0
    first, second = list(csv.DictReader(open(out)))
    assert first["status"] == "ok" or (first["status"] == "timeout" and "cut to the" in first["note"]), first
    assert second["status"] == "skipped" and "time budget of 21 s spent" in second["note"]


def test_paper_table_reads_the_recorded_measurements(tmp_path):
    import shutil

    from sinkflex_core.paths import data_dir

    for name in ("paper_claims.csv", "vram_recorded_h200.csv"):
        shutil.copy(data_dir() / name, tmp_path / name)
    table = bench.paper_vs_ours(tmp_path).set_index("claim")
    std4k = table.loc["peak VRAM, standard setup, 4,096 tokens"]
    assert std4k["paper"] == "28.06 GB" and std4k["from"] == "vram_recorded_h200.csv"
    assert std4k["ours"] == "23.27 GiB" and std4k["gap"].startswith("-4.79")
    std8k = table.loc["standard setup at 8,192 tokens"]
    assert std8k["paper"] == "OOM" and std8k["ours"].startswith("fits (32.22")
    assert table.loc["peak VRAM, SINKFLEX, 8,192 tokens", "ours"] == "not measured yet"
    # a harness CSV of the GPU machine takes precedence over the recorded one
    rows = bench.load_vram_results(tmp_path)
    assert set(rows["file"]) == {"vram_recorded_h200.csv"} and rows["recorded"].all()
    fresh = rows[rows["case"] == "sdpa/full/plain/4096"].copy()
    fresh["peak_gib"] = 30.0
    fresh.drop(columns=["file", "recorded"]).to_csv(tmp_path / "vram_h200.csv", index=False)
    table = bench.paper_vs_ours(tmp_path).set_index("claim")
    assert table.loc["peak VRAM, standard setup, 4,096 tokens", "ours"] == "30.00 GiB"
    # the reward claims: the sinkflex runs' start and end on the held-out tasks (means over seeds and tasks)
    import pandas as pd

    pd.DataFrame({"attention": ["sinkflex"] * 4 + ["sdpa"] * 2, "seed": [0, 0, 1, 1, 0, 0], "task": [0, 1] * 3,
                  "start_rate": [0.1, 0.2, 0.1, 0.2, 0.9, 0.9], "end_rate": [0.3, 0.5, 0.3, 0.5, 0.0, 0.0],
                  "hardware": "cpu"}).to_csv(tmp_path / "reward_curve_test.csv", index=False)
    table = bench.paper_vs_ours(tmp_path).set_index("claim")
    assert table.loc["retail mean reward at the start of GRPO training", "ours"] == "0.15 reward"
    assert table.loc["retail mean reward at the end of GRPO training", "ours"] == "0.40 reward"
    gain = table.loc["retail reward gained during GRPO training (end - start)"]
    assert gain["ours"] == "+0.25 reward" and gain["from"] == "reward_curve_test.csv"
    # a tiny CPU policy's reward beside the paper's 7B model's: side by side, no gap or percentage
    assert gain["gap"] == "not compared: other model scale"
    assert table.loc["retail mean reward at the start of GRPO training", "gap"] == "not compared: other model scale"


def test_readme_results_block_matches_the_data(tmp_path, capsys):
    from sinkflex_core.paths import data_dir, repo_root

    readme = (repo_root() / "README.md").read_text()
    assert bench.readme_with_results(readme) == readme, \
        "README's results block is out of date: run `sinkflex bench results --readme README.md`"
    expected = bench.results_markdown()
    assert "| retail reward gained during GRPO training (end - start) |" in expected
    # the command rewrites a stale block, leaves the rest of the file alone, and refuses a file without one
    stale = tmp_path / "README.md"
    stale.write_text(f"# title\n{bench.RESULTS_BEGIN}\n| old |\n{bench.RESULTS_END}\ntail\n")
    assert bench.main(["results", "--readme", str(stale), "--data", str(data_dir())]) == 0
    assert stale.read_text() == f"# title\n{bench.RESULTS_BEGIN}\n{expected}\n{bench.RESULTS_END}\ntail\n"
    assert "rewritten" in capsys.readouterr().out
    plain = tmp_path / "plain.md"
    plain.write_text("# no block\n")
    assert bench.main(["results", "--readme", str(plain)]) == 2
    assert "no results block" in capsys.readouterr().err and plain.read_text() == "# no block\n"
    assert bench.main(["results"]) == 0 and capsys.readouterr().out.strip() == expected
    # a --data folder without the paper's claims is refused, and the README's table is left as it was
    kept = stale.read_text()
    assert bench.main(["results", "--readme", str(stale), "--data", str(tmp_path / "typo")]) == 2
    assert "no paper_claims.csv" in capsys.readouterr().err and stale.read_text() == kept


def _gpu_row(case: str, peak: float, step_s: float, status: str = "ok") -> dict:
    attention, logprobs, mlp, tokens = case.split("/")
    row = dict.fromkeys(bench.COLUMNS, "")
    row.update(case=case, attention=attention, logprobs=logprobs, mlp=mlp, tokens=int(tokens), status=status,
               peak_gib=peak, memory_metric="cuda_max_allocated", step_s=step_s, cap_gib=80.0, device="cuda",
               gpu="NVIDIA H200")
    return row


def test_targets_and_figures_from_a_gpu_run(tmp_path):
    import pandas as pd

    rows = [_gpu_row("sinkflex/chunked/plain/8192", 18.2, 0.80), _gpu_row("sdpa/chunked/plain/8192", 19.1, 0.90),
            _gpu_row("sinkflex/chunked/tiled/65536", 40.0, 8.0), _gpu_row("sdpa/chunked/tiled/65536", 41.0, 15.0),
            _gpu_row("sinkflex/chunked/tiled/131072", 70.0, 30.0), _gpu_row("sdpa/chunked/tiled/131072", 72.0, 50.0),
            _gpu_row("eager/full/plain/16384", "", "", status="oom")]
    pd.DataFrame(rows).to_csv(tmp_path / "vram_h200.csv", index=False)
    report = bench.targets_report(bench.load_vram_results(tmp_path)).set_index("target")
    met = report["met"].tolist()
    assert met == ["yes", "yes", "yes", "no", "no"]  # 18.2 <= 18.5; 131k fits; 0.9/0.8; 15/8 < 2; 50/30 < 2
    assert report["measured"].iloc[1].startswith("131072 tokens (sinkflex/chunked/tiled/131072")
    made = bench.regenerate_figures(tmp_path, tmp_path / "fig").set_index("figure")
    assert made.loc["vram_vs_length.png", "status"] == "regenerated"
    assert (tmp_path / "fig" / "vram_vs_length.png").stat().st_size > 10_000
    assert made.loc["reward_curve.png", "status"].startswith("skipped")


def test_a_memory_line_with_the_same_peaks_as_another_stays_visible():
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    rows = [_gpu_row(f"{attention}/full/plain/{n}", peak, 1.0)
            for attention in ("flex", "sdpa") for n, peak in ((4096, 23.27), (8192, 32.22))]
    rows.append(_gpu_row("eager/full/plain/8192", 46.97, 1.0))
    ax = bench.plot_peak_vs_length(pd.DataFrame(rows))
    lines = {line.get_label(): line for line in ax.get_lines()}
    same = lines["sdpa · full logprobs · plain mlp (= flex · full logprobs · plain mlp)"]
    assert same.get_marker() == "D" and same.get_markerfacecolor() == "none"
    assert lines["flex · full logprobs · plain mlp"].get_marker() == "o"
    assert lines["eager · full logprobs · plain mlp"].get_marker() == "o"


def test_reward_figure_is_regenerated_from_the_recorded_curves(tmp_path):
    import pandas as pd

    pd.DataFrame({"attention": ["sinkflex"] * 3 + ["sdpa"] * 3, "seed": 0, "step": [0, 1, 2] * 2,
                  "reward_mean": [None, 0.1, 0.3, None, 0.2, 0.2], "parameters": 1.6e6}).to_csv(
        tmp_path / "reward_curve.csv", index=False)
    made = bench.regenerate_figures(tmp_path, tmp_path / "fig").set_index("figure")
    assert made.loc["reward_curve.png", "status"] == "regenerated"
    assert made.loc["reward_curve.png", "made_from"] == "reward_curve.csv"
    pd.DataFrame({"attention": ["sinkflex"] * 2 + ["sdpa"] * 2, "seed": 0, "task": [0, 1] * 2,
                  "start_successes": [0, 1, 0, 1], "end_successes": [2, 1, 0, 2], "tries": 4,
                  "start_rate": [0, 0.25, 0, 0.25], "end_rate": [0.5, 0.25, 0, 0.5]}).to_csv(
        tmp_path / "reward_curve_test.csv", index=False)
    made = bench.regenerate_figures(tmp_path, tmp_path / "fig").set_index("figure")
    assert made.loc["reward_curve.png", "made_from"] == "reward_curve.csv, reward_curve_test.csv"
    assert (tmp_path / "fig" / "reward_curve.png").stat().st_size > 10_000


def test_async_figures_are_regenerated_from_the_recording(tmp_path):
    import pandas as pd

    made = bench.regenerate_figures(tmp_path, tmp_path / "fig").set_index("figure")
    assert made.loc["async_curves.png", "status"].startswith("skipped")
    assert made.loc["async_timeline.png", "status"].startswith("skipped")
    configs = ["sync"] * 3 + ["async-k1"] * 3
    pd.DataFrame({"config": configs, "seed": 0, "step": [0, 1, 2] * 2,
                  "reward_mean": [None, 0.1, 0.3, None, 0.2, 0.2]}).to_csv(tmp_path / "async_curves.csv", index=False)
    pd.DataFrame({"config": ["sync", "sync", "async-k1", "async-k1"], "seed": 0, "task": [0, 1] * 2,
                  "start_rate": [0, 0.25, 0, 0.25], "end_rate": [0.5, 0.25, 0, 0.5], "end_tries": 2}).to_csv(
        tmp_path / "async_curves_test.csv", index=False)
    rows = [("sync", "learner", "rollout", 2, 0.0, 3.0), ("sync", "learner", "update", 2, 3.0, 5.0),
            ("async-k1", "learner", "wait", 2, 0.0, 0.1), ("async-k1", "learner", "update", 2, 0.1, 2.5),
            ("async-k1", "worker", "rollout", 3, 0.0, 3.2)]
    pd.DataFrame(rows, columns=["config", "lane", "activity", "step", "start", "end"]).assign(seed=0).to_csv(
        tmp_path / "async_timeline.csv", index=False)
    made = bench.regenerate_figures(tmp_path, tmp_path / "fig").set_index("figure")
    assert made.loc["async_curves.png", "made_from"] == "async_curves.csv, async_curves_test.csv"
    assert made.loc["async_timeline.png", "status"] == "regenerated"
    for name in ("async_curves.png", "async_timeline.png"):
        assert (tmp_path / "fig" / name).stat().st_size > 10_000


def test_bench_async_refuses_a_run_with_no_step_to_time(monkeypatch, capsys):
    """bench_async leaves step 1 out of its figures (it includes the worker's start): with --steps 1 it
    would train every configuration and then fail on the missing figures, so it is refused up front."""
    from benchmark_scripts import load_benchmark

    bench_async = load_benchmark("bench_async")
    monkeypatch.setattr(bench_async, "run_one", lambda *a, **k: pytest.fail("a configuration was run"))
    monkeypatch.setattr("sys.argv", ["bench_async.py", "--steps", "1", "--configs", "sync"])
    with pytest.raises(SystemExit) as exc:
        bench_async.main()
    assert exc.value.code == 2 and "--steps must be at least 2" in capsys.readouterr().err


def test_a_case_that_did_not_run_is_not_reported_as_out_of_memory(tmp_path):
    """A GPU run whose time budget ran out before the standard 8k case records it as 'skipped' (never run):
    the results table must not call that an out-of-memory, 'same outcome' as the paper's. A case skipped
    because a shorter length of it ran out of memory still reads OOM."""
    import io
    import shutil

    import pandas as pd

    from sinkflex_core.paths import data_dir

    shutil.copy(data_dir() / "paper_claims.csv", tmp_path / "paper_claims.csv")
    claim = "standard setup at 8,192 tokens"
    settings = bench.Settings(preset="tiny", device="cpu")
    rows = bench.run_cases([bench.Case("sdpa", "full", "plain", 8192)], settings, tmp_path / "vram_h200.csv",
                           budget_s=0.0, stream=io.StringIO())
    assert rows[0]["status"] == "skipped"
    assert bench.paper_vs_ours(tmp_path).set_index("claim").loc[claim, "ours"] == "not measured yet"
    for status, note in (("timeout", "no result within 120 s"), ("error", "RuntimeError: boom")):
        row = bench.row_for(bench.Case("sdpa", "full", "plain", 8192), settings.resolved(),
                            {"status": status, "note": note}, {})
        pd.DataFrame([row]).to_csv(tmp_path / "vram_h200.csv", index=False)
        assert bench.paper_vs_ours(tmp_path).set_index("claim").loc[claim, "ours"] == "not measured yet"
    row = bench.row_for(bench.Case("sdpa", "full", "plain", 8192), settings.resolved(),
                        {"status": "skipped", "note": "not run: the same case ran out of memory at 4096 tokens"}, {})
    pd.DataFrame([row]).to_csv(tmp_path / "vram_h200.csv", index=False)
    assert bench.paper_vs_ours(tmp_path).set_index("claim").loc[claim, "ours"] == "OOM"
def test_a_run_capped_at_the_whole_of_an_80_gb_card_counts_for_the_80_gib_target(tmp_path):
    """On an 80 GB H100, --cap-gib 80 leaves the whole card (~79.2 GiB), which run_case records as the
    cap in force; such a row is under the 80 GiB cap and counts for the longest-trajectory target."""
    import pandas as pd

    case = Case("sinkflex", "chunked", "tiled", 131072)
    settings = Settings(preset="qwen25-7b", device="cuda", cap_gib=80.0, dtype="bf16", chunk_size=512,
                        slice_tokens=8192, window=4096)
    result = {"status": "ok", "cap_gib": 79.19, "peak_gib": 61.0, "memory_metric": "cuda_max_allocated"}
    row = bench.row_for(case, settings, result, {"gpu": "NVIDIA H100 80GB HBM3"})
    pd.DataFrame([row]).to_csv(tmp_path / "vram_h100-80gb-hbm3.csv", index=False)
    report = bench.targets_report(bench.load_vram_results(tmp_path)).set_index("target")
    longest = report.loc["longest trajectory under the 80 GiB cap: 131,072 tokens"]
    assert longest["measured"].startswith("131072 tokens") and longest["met"] == "yes"


def test_the_training_reward_plot_names_a_seed_that_recorded_no_step():
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from sinkflex_core.plots import plot_training_reward

    df = pd.DataFrame({"seed": [0, 0, 1, 1, 2], "step": [1, 2, 1, 2, 1],
                       "reward_mean": [0.1, 0.2, 0.3, 0.4, float("nan")]})
    labels = [h.get_label() for h in plot_training_reward(df, label="sinkflex").get_lines()]
    assert "sinkflex mean of 2 seeds" in labels
    assert "sinkflex no step recorded: seed 2" in labels
