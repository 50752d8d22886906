"""How long a tiny model from random weights takes to learn to copy, with and without previous-token
heads built into its first layer (``sinkflex_core.models.init_previous_token_heads``).

Both arms train the same tiny Qwen2 policy shape (hidden 128, 4 layers, 4 heads, 2 KV heads, vocabulary
3,072) from the same seed on the same stream of copy drills (``sinkflex_core.sft.copy_drills``: a
random segment of 8 to 64 token ids, repeated to 128 tokens, scored on the repeats), with AdamW at a
constant learning rate. Prints, every ``--every`` steps, each arm's loss and the share of repeated
tokens it predicts (greedy) on that step's batch, and the step where each first reaches 50 %.

    python benchmarks/bench_copy_plateau.py                    # 1,000 steps per arm, ~18 min on 2 cores
    python benchmarks/bench_copy_plateau.py --fit-positions 128 --csv data/copy_plateau_fit128.csv
    python benchmarks/bench_copy_plateau.py --steps 50 --every 10   # smoke run
"""

from __future__ import annotations

import argparse
import csv
import functools
import time
from pathlib import Path

import numpy as np
import torch

print = functools.partial(print, flush=True)  # progress shows when the output goes to a file


VOCAB = 3072  # the policy's vocabulary; drill tokens are ids 3 .. 3 + alphabet - 1 (0-2: special tokens)


def run_arm(previous_heads: bool, args) -> list[dict]:
    from sinkflex_core import sft
    from sinkflex_core.models import build_model, init_previous_token_heads, tiny_qwen2_config

    cfg = tiny_qwen2_config(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                            num_kv_heads=2)
    cfg._attn_implementation = "sdpa"
    model = build_model(cfg, seed=args.seed)
    t0 = time.perf_counter()
    if previous_heads:
        mins = init_previous_token_heads(model, n_pos=args.fit_positions)
        print(f"previous-token heads: smallest attention on the target position {min(mins):.3f} "
              f"({time.perf_counter() - t0:.0f} s to fit)")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = np.random.default_rng(args.seed)
    token_ids = torch.arange(3, 3 + args.alphabet)
    rows = []
    for step in range(1, args.steps + 1):
        ids, mask = sft.copy_drills(args.rows, args.length, token_ids, rng)
        logits = model(input_ids=ids).logits[:, :-1].float()
        target, scored = ids[:, 1:], mask[:, 1:]
        logp = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
        loss = -(logp * scored).sum() / scored.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0 or step == args.steps:
            acc = float(((logits.argmax(-1) == target).float() * scored).sum() / scored.sum())
            rows.append({"arm": "previous_token_heads" if previous_heads else "random_init", "step": step,
                         "loss": round(loss.item(), 4), "copy_accuracy": round(acc, 4),
                         "elapsed_s": round(time.perf_counter() - t0, 1)})
            print(f"{rows[-1]['arm']:>20} step {step:5d}  loss {loss.item():6.3f}  copied {acc:6.1%}  "
                  f"{rows[-1]['elapsed_s']:6.0f} s")
    return rows


def main(argv: list[str] | None = None) -> None:
    from sinkflex_core.provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--alphabet", type=int, default=3000, help="drill tokens are drawn from this many ids")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--fit-positions", type=int, default=2048,
                   help="positions the previous-token biases are fitted over (the SFT uses max_total_tokens, 2048)")
    p.add_argument("--arms", choices=("both", "random", "heads"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--csv", default=None, help="write every printed row, with provenance, to this file")
    args = p.parse_args(argv)
    # each failed only mid-run (or, for the CSV, at its end, after both arms had trained)
    if min(args.steps, args.every, args.rows) < 1 or not 1 <= args.alphabet <= VOCAB - 3 or args.length < 16:
        p.error(f"--steps, --every and --rows must be >= 1, --alphabet in 1..{VOCAB - 3} (the ids of the "
                f"vocabulary of {VOCAB} after its 3 special tokens) and --length >= 16 (a segment of 8 tokens "
                "at least, repeated)")
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"copy drills: {args.rows} rows x {args.length} tokens from {args.alphabet} ids; lr {args.lr}; "
          f"hidden {args.hidden}, {args.layers} layers; {torch.get_num_threads()} threads; "
          f"chance level: loss ln({args.alphabet}) = {np.log(args.alphabet):.2f}")
    rows = (run_arm(False, args) if args.arms != "heads" else []) + (run_arm(True, args) if args.arms != "random" else [])
    for arm in ("random_init", "previous_token_heads"):
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        first = next((r["step"] for r in mine if r["copy_accuracy"] >= 0.5), None)
        print(f"{arm:>20}: final loss {mine[-1]['loss']:.3f}, copied {mine[-1]['copy_accuracy']:.1%}; "
              f"first >= 50 % at step {first if first else f'> {args.steps}'}")
    if args.csv:
        from sinkflex_core.provenance import provenance

        prov = provenance(seed=args.seed, threads=torch.get_num_threads(), rows=args.rows, length=args.length,
                          alphabet=args.alphabet, hidden=args.hidden, layers=args.layers, lr=args.lr,
                          fit_positions=args.fit_positions)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(prov))
            w.writeheader()
            for r in rows:
                w.writerow({**r, **prov})
        print(f"written: {args.csv}")


if __name__ == "__main__":
    main()
