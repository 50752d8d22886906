"""Can the start policy pick an exchange's new item by the options the customer names, and under which
layout of the product record?

An exchange (or an item change) asks for a variant of a product by its option values ("exchange the
Smart Watch (grey, vintage) to (red, classic)"); the assistant finds the variant's item id in
``get_product_details``' answer and writes it into its confirmation. Each drill row is that part of an
episode in the chat format of the episodes: the request, the product lookup, the product record in one
of the layouts below (a product of the world with its variants' options, availability and prices, and
fresh random ten-digit item ids, so that no id can be remembered), then the assistant's confirmation up
to the new item's id. Only the confirmation's new values are scored: the id's tokens, and with
``--phrase to`` also the new option values the confirmation names right before the id.

Layouts of one variant in the record (``--layouts``):

- ``world``: the store's record, ``{"item_id": "<id>", "options": {"color": "red", "style": "classic"}, ...}``
  (the options after the id);
- ``joined``: ``{"red, classic": "<id>", ...}``, the values as the customer writes them, right before the id;
- ``tight``: ``{"red classic": "<id>", ...}``, the values with a space only;
- ``each``: ``{"red": "<id>", "classic": "<id>", ...}``, the id after each value.

``--phrase for`` confirms "... (grey, vintage) for <id>"; ``--phrase to`` confirms "... (grey, vintage) to
red, classic <id>" (``tight``: "red classic"), so that the values the pick rests on stand right before the
id, as they do in the record, and as the item's name stands before its id in an order's record.

Each arm starts from the policy's weights with full attention (the rows, 440-690 tokens, are shorter
than the shipped start's window), trains on ``--rows`` fresh rows a step (AdamW, lr 1e-3 falling to 0.3
of it on a cosine), and is checked every ``--every`` steps on ``--eval-rows`` fixed rows: the id's first
token (argmax) right, the whole id right (teacher-forced), the first token of the customer's old item
(the request and the confirmation both name it) and the new values copied. Beside them, what a pick by
one value alone would get: the variants that share the asked item's last (or first) option value are
counted in each row, and ``bound_last`` (``bound_first``) is the expected number right for a uniform pick
among them; ``wrong_same_last`` counts the wrong picks that share the last value.

    python benchmarks/variant_pick_drill.py --phrase for --layouts each          # ~11 min on 2 cores
    python benchmarks/variant_pick_drill.py --layouts joined,tight,each          # ~30 min
    python benchmarks/variant_pick_drill.py --layouts tight --steps 1500 --csv data/variant_pick_drill_tight1500.csv
    python benchmarks/variant_pick_drill.py --steps 2 --every 1 --rows 2 --eval-rows 4   # smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

print = functools.partial(print, flush=True)  # progress shows when the output goes to a file

LAYOUTS = ("world", "joined", "tight", "each")
PHRASES = ("for", "to")


def variant_record(options: dict, item_id: str, available: bool, price: float, layout: str) -> dict:
    """One variant of ``get_product_details``' answer in ``layout``."""
    values = list(options.values())
    if layout == "world":
        return {"item_id": item_id, "options": options, "available": available, "price": price}
    if layout == "joined":
        record = {", ".join(values): item_id}
    elif layout == "tight":
        record = {" ".join(values): item_id}
    elif layout == "each":
        record = dict.fromkeys(values, item_id)
    else:
        raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    return {**record, "available": available, "price": price}


def _first_token(tokenizer, text: str, at: int) -> int:
    return tokenizer(text, add_special_tokens=False)["input_ids"][at]


def make_row(rng: random.Random, tokenizer, products: list[dict], variants: dict, layout: str,
             phrase: str) -> dict:
    """One drill row: ``input_ids`` and ``mask`` (the scored tokens), the index ``slot`` of the new id's
    first token, ``values_at`` (where the scored values start), the old item's first id token and the
    first id tokens of the other variants sharing the asked last / first option value, with their counts
    (the asked one included)."""
    while True:
        product = rng.choice(products)
        group = [variants[i] for i in product["item_ids"]]
        available = [v for v in group if v["available"]]
        if len(available) >= 2:
            break
    old = rng.choice(group)
    new = rng.choice([v for v in available if v is not old])
    ids = {v["item_id"]: str(rng.randrange(10**9, 10**10)) for v in group}
    order_id = "#W" + str(rng.randrange(10**6, 10**7))
    old_text, new_text = ", ".join(old["options"].values()), ", ".join(new["options"].values())
    record = {"product_id": product["product_id"], "name": product["name"],
              "variants": [variant_record(v["options"], ids[v["item_id"]], v["available"], v["price_cents"] / 100,
                                          layout) for v in group]}
    messages = [
        {"role": "user", "content": f"Hi! Please exchange the {product['name']} ({old_text}) to ({new_text}) in order "
                                    f"{order_id} and pay any difference with my gift card."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_product_details", "arguments": {"product_id": product["product_id"]}}}]},
        {"role": "tool", "content": json.dumps(record, separators=(",", ":"))}]
    head = tokenizer.apply_chat_template(messages, tokenize=False) + "<|im_start|>assistant\n"
    said = f"I will exchange the {product['name']} {ids[old['item_id']]} ({old_text}) "
    if phrase == "for":
        before_values = before_id = head + said + "for "
    else:
        before_values = head + said + "to "
        before_id = before_values + (" ".join(new["options"].values()) if layout == "tight" else new_text) + " "
    target = ids[new["item_id"]]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    values_at, slot = len(encode(before_values)), len(encode(before_id))
    end = len(encode(before_id + target))
    if encode(before_id + target)[:slot] != encode(before_id):
        raise ValueError("the id's tokens merge with the text before it: the slot is not a token boundary")
    input_ids = torch.tensor(encode(before_id + target + f" in order {order_id}. Proceed? (yes/no)<|im_end|>\n"))
    mask = torch.zeros(len(input_ids), dtype=torch.bool)
    mask[values_at:end] = True
    asked = list(new["options"].values())
    same_last = [v for v in group if list(v["options"].values())[-1] == asked[-1]]
    same_first = [v for v in group if list(v["options"].values())[0] == asked[0]]
    others = lambda same: {_first_token(tokenizer, before_id + ids[v["item_id"]], slot) for v in same if v is not new}
    return {"input_ids": input_ids, "mask": mask, "slot": slot, "values_at": values_at,
            "old_first": _first_token(tokenizer, before_id + ids[old["item_id"]], slot),
            "same_last": others(same_last), "same_first": others(same_first),
            "n_same_last": len(same_last), "n_same_first": len(same_first)}


def batch(rows: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``mask`` and ``attention_mask`` of ``rows``."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id)
    mask = torch.zeros((len(rows), length), dtype=torch.bool)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n], attention[i, :n] = r["input_ids"], r["mask"], 1
    return ids, mask, attention


@torch.no_grad()
def check(model, rows: list[dict], pad_id: int, chunk: int = 16) -> dict:
    """Counts over ``rows`` (see the module's docstring)."""
    was_training = model.training
    model.eval()
    out = dict.fromkeys(("first_token_right", "whole_id_right", "old_item_first", "values_copied",
                         "wrong_same_last", "wrong_same_first"), 0)
    for i in range(0, len(rows), chunk):
        part = rows[i:i + chunk]
        ids, mask, attention = batch(part, pad_id)
        pred = model(input_ids=ids, attention_mask=attention).logits.argmax(-1)
        for j, r in enumerate(part):
            s, v = r["slot"], r["values_at"]
            n = int(r["mask"].sum())
            pick = int(pred[j, s - 1])
            right = pick == int(ids[j, s])
            out["first_token_right"] += right
            out["whole_id_right"] += bool((pred[j, s - 1:v + n - 1] == ids[j, s:v + n]).all())
            out["old_item_first"] += pick == r["old_first"]
            out["values_copied"] += bool((pred[j, v - 1:s - 1] == ids[j, v:s]).all())
            out["wrong_same_last"] += pick in r["same_last"]
            out["wrong_same_first"] += pick in r["same_first"]
    model.train(was_training)
    return out


def run_arm(layout: str, args) -> list[dict]:
    from sinkflex_core.envs.retail_world import generate_world
    from sinkflex_core.models import load_policy, load_tokenizer

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.policy)
    pad_id = tokenizer.pad_token_id or 0
    world = generate_world(0)
    products = list(world.products.values())
    draw = lambda rng: make_row(rng, tokenizer, products, world.variants, layout, args.phrase)
    eval_rng = random.Random(12345)
    fixed = [draw(eval_rng) for _ in range(args.eval_rows)]
    bound_last = sum(1 / r["n_same_last"] for r in fixed)
    bound_first = sum(1 / r["n_same_first"] for r in fixed)
    model = load_policy(args.policy, saved_attention=False)
    tokens = sum(len(r["input_ids"]) for r in fixed) / len(fixed)
    print(f"{layout}, phrase {args.phrase!r}: {tokens:.0f} tokens a row; a pick by the last value alone gets "
          f"{bound_last:.1f} of {args.eval_rows} right, by the first value alone {bound_first:.1f}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    cosine = lambda s: 0.3 + 0.7 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, cosine)
    rng = random.Random(args.seed)
    results = []

    def record(step: int, loss: float | None, seconds: float) -> None:
        counts = check(model, fixed, pad_id)
        results.append({"layout": layout, "phrase": args.phrase, "step": step,
                        "loss": None if loss is None else round(loss, 4), **counts, "eval_rows": args.eval_rows,
                        "bound_last": round(bound_last, 1), "bound_first": round(bound_first, 1),
                        "s_per_step": round(seconds, 2)})
        print(f"{layout:>7} step {step:5d}  loss {'-' if loss is None else f'{loss:.3f}':>6}  first id token "
              f"{counts['first_token_right']}/{args.eval_rows}  whole id {counts['whole_id_right']}  old item "
              f"{counts['old_item_first']}  values copied {counts['values_copied']}  wrong with the last value "
              f"{counts['wrong_same_last']}, the first {counts['wrong_same_first']}")

    record(0, None, 0.0)
    model.train()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, mask, attention = batch([draw(rng) for _ in range(args.rows)], pad_id)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        scored = mask[:, 1:]
        loss = F.cross_entropy(logits[scored], ids[:, 1:][scored])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if step % args.every == 0 or step == args.steps:
            record(step, loss.item(), (time.perf_counter() - t0) / step)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    from sinkflex_core.provenance import pin_git_sha
    from sinkflex_core.start import start_dir

    pin_git_sha()  # the commit that runs, named in every result this run writes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=str(start_dir()), help="a saved policy folder (default: the shipped start)")
    p.add_argument("--layouts", default="joined,tight,each", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--phrase", choices=PHRASES, default="to")
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--every", type=int, default=150)
    p.add_argument("--rows", type=int, default=16, help="fresh training rows a step")
    p.add_argument("--eval-rows", type=int, default=80)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--csv", default=None, help="write every printed row, with provenance, to this file")
    args = p.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    # checked before any arm loads a model or trains
    if min(args.steps, args.every, args.rows, args.eval_rows) < 1:
        p.error("--steps, --every, --rows and --eval-rows must be >= 1")
    if not layouts or any(x not in LAYOUTS for x in layouts):
        p.error(f"--layouts must name one or more of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    if not (Path(args.policy) / "model.safetensors").is_file():
        p.error(f"--policy {args.policy}: no model.safetensors there")
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [row for layout in layouts for row in run_arm(layout, args)]
    if args.csv:
        import pandas as pd

        from sinkflex_core.provenance import provenance

        prov = provenance(seed=args.seed, threads=torch.get_num_threads(), rows=args.rows, lr=args.lr,
                          policy=Path(args.policy).name)
        pd.DataFrame([{**r, **prov} for r in results]).to_csv(args.csv, index=False)
        print(f"written: {args.csv}")
    return results


if __name__ == "__main__":
    main()
