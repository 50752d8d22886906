"""The recipe of this policy: short rows of the address calls drilled alone, then rounds of the sink stage.

Run from the repository root, in three pieces (as it was made; each piece draws its batches from seed 0):

    python data/retail-tiny-address-drill/recipe/address_drill.py data/retail-tiny-start runs/ad/d1 1500 600 0
    python data/retail-tiny-address-drill/recipe/address_drill.py runs/ad/d1/drill runs/ad/d2 600 600 1
    python data/retail-tiny-address-drill/recipe/address_drill.py runs/ad/d2/rec1 runs/ad/d3 0 600 1

Arguments: the policy to continue, the output folder, the most drill steps (it stops early once the first
tokens of the street, the city and the new zip are right in 80 % of the 23 address test tasks, checked every
150 steps), the steps of a recovery round, the number of rounds. The drill: 12 short rows a step
(``sft_data.short_context``) cut at the two address tools and the messages right before their calls, AdamW at
lr 1e-3 after a 10-step warm-up. A round: ``start.sink_stage_config`` with the same rows, 4 short rows a step.
Each saved folder also holds the base's ``sft_config.json`` (out_dir changed) so that the next piece can
continue it. About 68 minutes of drill and 22 minutes a round on 2 cores of an Intel Xeon.
"""

import collections
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sinkflex_core import sft, start
from sinkflex_core.sft_data import token_texts, value_start_mask, value_start_tokens
from sinkflex_core.train import task_kinds

ADDRESS_TOOLS = "modify_pending_order_address,modify_user_address"


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def main(base: str, out: Path, drill_max: int, rec_steps: int, rec_rounds: int, drill_rows: int = 12) -> None:
    torch.set_num_threads(2)
    cfg = start.sink_stage_config(base, out / "rec", action_tools=ADDRESS_TOOLS, action_messages=True,
                                  action_confirmations=True, short_action_rows=4, threads=2, progress=False,
                                  max_steps=rec_steps, eval_every=rec_steps)
    cfg.validate()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    val_ids, n_train = sft._task_split(cfg)
    tok, data, openings = sft._expert_data(cfg, n_train)
    model = sft._build_model(cfg, tok)
    policy = sft.TokenLogprobs(model)
    kit = sft._prepare(policy, cfg, tok, data, openings, val_ids, rng)
    log("kit ready", len(kit.cuts), "cuts")
    kinds = task_kinds("test", list(range(120)))
    tasks = [t for t, k in zip(range(120), kinds) if k in ADDRESS_TOOLS.split(",")]
    examples = sft.expert_examples(tok, sft.SFTConfig(), tasks, split="test")
    texts, tables = token_texts(tok), value_start_tokens(tok)

    def check(tag: str) -> dict[str, float]:
        """Teacher-forced first tokens of the values of the address tasks' oracle calls (the last zip of an
        episode is the new address's: ``zip_new``)."""
        model.eval()
        stats = collections.defaultdict(lambda: [0, 0, 0])
        with torch.no_grad():
            for e in examples:
                ids = e["input_ids"]
                pred = model(input_ids=ids[None]).logits[0].argmax(-1)
                seen = []
                for s in value_start_mask(ids[None], e["loss_mask"][None], *tables)[0].nonzero().flatten().tolist():
                    keys = re.findall(r'(\w+)":', "".join(texts[int(t)] for t in ids[max(0, s - 6):s]))
                    end = s
                    while end < len(ids) and '"' not in texts[int(ids[end])]:
                        end += 1
                    hits = [int(pred[p - 1]) == int(ids[p]) for p in range(s, max(s + 1, end))]
                    seen.append((keys[-1] if keys else "?", hits[0], all(hits)))
                zips = [i for i, (k, _, _) in enumerate(seen) if k == "zip"]
                for i, (k, first, whole) in enumerate(seen):
                    row = stats["zip_new" if k == "zip" and i == zips[-1] else k]
                    row[0] += 1
                    row[1] += first
                    row[2] += whole
        model.train()
        shown = ("address1", "address2", "city", "state", "zip", "zip_new")
        log(tag, " ".join(f"{k} {f}/{n}({w})" for k, (n, f, w) in sorted(stats.items()) if k in shown))
        return {k: v[1] / v[0] for k, v in stats.items()}

    def save(name: str) -> None:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        model.eval()
        sft._save_policy(model, tok, folder)
        model.train()
        saved = {**json.loads(Path(base, "sft_config.json").read_text()), "out_dir": str(folder)}
        (folder / "sft_config.json").write_text(json.dumps(saved))
        shutil.copy(Path(base) / "sinkflex_sinks.json", folder / "sinkflex_sinks.json")
        log("saved", folder)

    check("start")
    if drill_max:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        for step in range(1, drill_max + 1):
            for g in opt.param_groups:
                g["lr"] = cfg.lr * min(1.0, step / 10)
            batch = sft.action_batch(kit.data, kit.cuts, drill_rows, rng, kit.pad, kit.tables, kit.identity_groups,
                                     kit.quotes, short=kit.short)
            loss, _ = sft.sft_loss(policy, batch)
            sft.descend(loss, model, opt, cfg.grad_clip)
            if step % 150 == 0:
                acc = check(f"drill {step} loss {loss.item():.3f}")
                if min(acc.get("address1", 0), acc.get("city", 0), acc.get("zip_new", 0)) >= 0.8:
                    break
        save("drill")
    for r in range(rec_rounds):
        progress = sft._train_loop(policy, cfg, kit, rng, None)
        check(f"recovery round {r + 1} ({progress.step} steps)")
        save(f"rec{r + 1}")
    log("done")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:]))
