"""benchmarks/bench_rollout.py: what its headers say about the workloads (the timed work is a stand-in)."""

from __future__ import annotations

import re

from benchmark_scripts import load_benchmark


def test_the_share_of_the_vocabulary_that_ends_a_turn_is_the_one_used(monkeypatch, capsys):
    bench = load_benchmark("bench_rollout")
    stops_seen = []

    def sessions(backend, *args, **kwargs):
        return {"seconds": 1.0, "cpu": 1.0, "generated": 1, "episodes": 1, "samples": [], "final_len": 1}

    def episodes(backend, *args, **kwargs):
        stops_seen.append(set(backend.stop_token_ids))
        return {"seconds": 1.0, "generated": 1, "episodes": 1, "turns": 1.0, "samples": []}

    monkeypatch.setattr(bench, "synthetic_sessions", sessions)
    monkeypatch.setattr(bench, "end_to_end", episodes)
    monkeypatch.setattr("sys.argv", ["bench_rollout.py", "--quick", "--no-vllm"])
    bench.main()
    printed = capsys.readouterr().out
    from sinkflex_core.models import get_tokenizer

    vocabulary = len(get_tokenizer())
    said = [int(x) for x in re.findall(r"~(\d+)% of the vocabulary ends a turn", printed)]
    # the retail sections: stock and fast path with one set of stops, then the end-to-end one
    assert len(said) == 2 and len(stops_seen) == 3 and stops_seen[0] == stops_seen[1]
    for share, stops in zip(said, (stops_seen[0], stops_seen[2])):
        assert share == round(100 * len(stops) / vocabulary), (share, len(stops), vocabulary)
