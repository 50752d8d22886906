"""The time of one SFT optimizer step (``sft.sft_loss`` on a batch of the retail oracle's episodes,
backward, gradient clipping, AdamW) for models of several shapes, in float32 and with ``bf16``
(``SFTConfig.bf16``: the decoder under ``torch.autocast`` in bfloat16, weights, optimizer and the log-prob
head in float32), each from the same weights on the same batch.

    python benchmarks/bench_sft_step.py --threads 2
    python benchmarks/bench_sft_step.py --shapes 128x4 256x4 --repeats 2 --tasks 4   # seconds

A shape is ``HIDDENxLAYERS`` (heads of 32 dimensions, half as many key-value heads, as the shipped
start). Printed per shape: the median step time of each precision over ``--repeats`` steps (after one
untimed step), its tokens per second, the bf16 step's speed-up, and the gap between the two losses of the
first step (bfloat16's rounding, not another model).
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time

import torch

print = functools.partial(print, flush=True)  # progress shows when the output goes to a file


def shape_of(text: str) -> tuple[int, int]:
    try:
        hidden, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is HIDDENxLAYERS (e.g. 256x4), got {text!r}") from None
    if hidden < 64 or hidden % 64 or layers < 1:
        raise argparse.ArgumentTypeError(f"hidden must be a multiple of 64 and layers >= 1, got {text!r}")
    return hidden, layers


def oracle_batch(tokenizer, tasks: int, batch_tokens: int) -> dict:
    """The first ``tasks`` synthetic tasks' oracle episodes, as many as fit ``batch_tokens`` padded."""
    from sinkflex_core import sft
    from sinkflex_core.sft_data import collate, expert_examples

    examples = expert_examples(tokenizer, sft.SFTConfig(), list(range(tasks)), split="synthetic")
    examples.sort(key=lambda e: len(e["input_ids"]))
    rows = max(1, batch_tokens // len(examples[-1]["input_ids"]))
    return collate(examples[-rows:], tokenizer.pad_token_id)


def step_times(hidden: int, layers: int, bf16: bool, batch: dict, tokenizer, repeats: int, seed: int = 0):
    from sinkflex_core import models, sft
    from sinkflex_core.train.policy import TokenLogprobs

    heads = hidden // 32
    config = models.tiny_qwen2_config(len(tokenizer), hidden_size=hidden, num_layers=layers, num_heads=heads,
                                      num_kv_heads=max(1, heads // 2), tokenizer=tokenizer)
    config._attn_implementation = "sdpa"
    model = models.build_model(config, seed=seed).train()
    policy = TokenLogprobs(model, autocast_dtype=torch.bfloat16 if bf16 else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    times, first = [], None
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        loss, _ = sft.sft_loss(policy, batch, context_weight=1.0)
        sft.descend(loss, model, opt, grad_clip=1.0)
        if i == 0:
            first = loss.item()
        else:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), first, sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=shape_of, default=[(128, 4), (256, 4), (256, 6), (384, 6)],
                   help="model shapes HIDDENxLAYERS (default: the shipped start's 128x4 and three larger)")
    p.add_argument("--tasks", type=int, default=16, help="synthetic tasks whose oracle episodes make the batch")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens of the batch (the recipe's)")
    p.add_argument("--repeats", type=int, default=4, help="timed steps per precision (after one untimed step)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.tasks < 1 or args.batch_tokens < 1 or args.repeats < 1 or args.threads < 0:
        p.error("--tasks, --batch-tokens and --repeats must be >= 1, --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    from sinkflex_core.models import get_tokenizer

    tokenizer = get_tokenizer()
    batch = oracle_batch(tokenizer, args.tasks, args.batch_tokens)
    B, L = batch["input_ids"].shape
    cpu = platform.processor() or platform.machine()
    print(f"# one SFT step on {B} oracle episodes padded to {L} tokens ({B * L} in all); {cpu}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for hidden, layers in args.shapes:
        fp32, loss32, n = step_times(hidden, layers, False, batch, tokenizer, args.repeats)
        bf16, loss16, _ = step_times(hidden, layers, True, batch, tokenizer, args.repeats)
        print(f"{hidden}x{layers} ({n / 1e6:.2f}M parameters): float32 {fp32:.3g} s ({B * L / fp32:,.0f} tokens/s), "
              f"bf16 {bf16:.3g} s ({B * L / bf16:,.0f} tokens/s), x{fp32 / bf16:.2f}; first loss "
              f"{loss32:.4f} vs {loss16:.4f} (gap {abs(loss32 - loss16):.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
