"""The start policy of the small-scale reproduction, shipped in the repository.

The paper starts GRPO from an instruct checkpoint (Qwen2.5-7B-Instruct). Nothing here downloads
weights, so the repository ships its own start: a tiny Qwen2 trained on the retail oracle's episodes
by the SFT recipe of :mod:`sinkflex_core.sft` (:class:`~sinkflex_core.sft.SFTConfig`'s defaults for
:data:`RECIPE`'s steps), then the lookup stage's rounds (:data:`LOOKUP_ROUNDS`), the zip stage
(:data:`ZIP_DRILLS`, :data:`ZIP_ROUND_STEPS`), the sink stage, trained with the sink attention GRPO's
``tiny-cpu`` preset plays it with (:func:`sink_stage_config`, :data:`SINK_STAGE_STEPS`), then the
address stage on that attention (:data:`ADDRESS_ROWS`, :data:`ADDRESS_RUNS`) and last the payment stage
(:data:`PAYMENT_ROWS`, :data:`PAYMENT_RUNS`): ``--lookup-stage --zip-stage --sink-stage --address-stage
--payment-stage`` below. It lives in ``data/retail-tiny-start/`` with what GRPO needs beside the weights:

- ``sinkflex_sinks.json``: the per-layer sink counts estimated from this policy (with a sink stage: from
  the stage before it, which it trained with; :func:`sinkflex_core.attention.estimate_layer_sinks` on
  expert episodes of the training split), which the ``tiny-cpu`` preset's sink attention uses;
- ``test_rewards.csv``: every test task played ``--test-samples`` times, with full attention and with
  the preset's sink attention (the start's reward; column ``attention``; a start trained with sink
  attention: with its own and with its weights under full attention);
- ``train_screen.csv``: the training tasks played ``--screen-samples`` times with the preset's
  attention, the screen GRPO trains on (:func:`sinkflex_core.train.screened_tasks`);
- ``recipe/``: the config and history of each stage of the SFT (a run of warm-ups alone, the address
  or the payment drill, has an empty history);
- with ``--sink-stage``, ``--address-stage`` or ``--payment-stage``, ``sinkflex_attention.json`` and the
  learned sink logits in the weights: the last stage trained with the preset's sink attention
  (:func:`sink_stage_config`), which :func:`sinkflex_core.models.load_policy` restores;
- ``README.md``: the model card, written from the files above.

Regenerate it (about seven and a half hours on 2 cores; each finished part is reused when run again)::

    python -m sinkflex_core.start --lookup-stage --zip-stage --sink-stage --address-stage --payment-stage  # the shipped start
    python -m sinkflex_core.start --lookup-stage --zip-stage --sink-stage --address-stage  # the start shipped before it
    python -m sinkflex_core.start --lookup-stage --zip-stage --sink-stage  # the one before, without the address stage
    python -m sinkflex_core.start                    # the first SFT stage alone
    python -m sinkflex_core.start --sink-stage       # the first stage, then a stage on the preset's sink attention
    python -m sinkflex_core.start --lookup-stage     # + two rounds drilling the tool calls' lookups
    python -m sinkflex_core.start --from data/retail-tiny-start --return-stage --out runs/start/return_policy
                                                     # the shipped start continued with the return stage
    python -m sinkflex_core.start --card-only        # rewrite README.md from the files in the folder
    python -m sinkflex_core.start --measure-only     # measure it again (e.g. after a reward change), then the card
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .paths import repo_root

if TYPE_CHECKING:
    import pandas as pd

#: Where the shipped start lives, relative to the repository's root.
START_SUBDIR = Path("data") / "retail-tiny-start"
#: The files of a saved policy that travel with the start (the rest of an SFT folder stays behind).
POLICY_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "sinkflex_attention.json", "sinkflex_sinks.json")


def start_dir() -> Path:
    """``data/retail-tiny-start`` in this repository: the policy GRPO's ``tiny-cpu`` preset starts from."""
    return repo_root() / START_SUBDIR


def sink_settings(folder: str | Path | None = None) -> dict:
    """The keyword arguments of :func:`sinkflex_core.attention.apply` with which a ``tiny-cpu`` run plays
    the start in ``folder`` (default: :func:`start_dir`): the preset's sinks, window and learned sink,
    and the per-layer counts of the folder's ``sinkflex_sinks.json``; a folder without that file whose
    policy was trained with per-layer counts (an SFT run with sink attention writes them to its
    ``sinkflex_attention.json``) keeps the counts it trained with."""
    from . import attention
    from .train import resolve_config

    folder = Path(folder) if folder is not None else start_dir()
    cfg = resolve_config("tiny-cpu")
    counts: str | list[int] = str(folder / attention.SINKS_FILENAME)
    if not (folder / attention.SINKS_FILENAME).is_file():
        trained = attention.attention_settings(folder)  # None where the folder holds no sink attention
        if trained and trained["layer_sinks"]:
            counts = trained["layer_sinks"]
    return {"n_sink": cfg.n_sink, "window": cfg.window, "learn_sinks": cfg.learn_sinks, "layer_sinks": counts}


def preset_sinks(folder: str | Path | None = None) -> dict | None:
    """The ``sinks=`` with which :func:`sinkflex_core.train.success_table` (and ``screen_or_reuse``) play
    the start in ``folder`` as a ``tiny-cpu`` run starts it: None for a start saved with sink attention
    (the sink stage: it plays its own, saved attention), else :func:`sink_settings`."""
    from . import attention

    folder = Path(folder) if folder is not None else start_dir()
    return None if attention.attention_settings(folder) is not None else sink_settings(folder)


def estimate_sinks(policy_dir: str | Path) -> Path:
    """Estimate the per-layer sink counts of the policy in ``policy_dir`` as a ``tiny-cpu`` run with
    ``layer_sinks="auto"`` would (:func:`sinkflex_core.train.layer_sinks.resolve_layer_sinks`: the
    oracle's episodes of the first training tasks, at least ``n_sink`` per layer) and save them there
    (``sinkflex_sinks.json``); returns the file."""
    import torch

    from . import attention, models
    from .train import resolve_config
    from .train.layer_sinks import expert_calibration_ids

    cfg = resolve_config("tiny-cpu", {"model": str(policy_dir)})
    model = models.load_policy(policy_dir, attn_implementation="sdpa")
    ids = expert_calibration_ids(cfg, models.load_tokenizer(str(policy_dir)))
    with torch.no_grad():
        est = attention.estimate_layer_sinks(model, ids, min_sinks=cfg.n_sink, max_sinks=max(16, cfg.n_sink))
    return attention.save_layer_sinks(est, policy_dir)


def _export(source: Path, out: Path, stages: list[Path], base: Path | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in POLICY_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    shutil.copy2(source / "sft_config.json", out / "sft_config.json")
    recipe = out / "recipe"
    recipe.mkdir(exist_ok=True)
    carried = [label for label, _, _ in recipe_stages(base)] if base is not None else []
    for label in carried:  # a start continued from another (never its own out): its stages first, as named there
        for suffix in ("_config.json", "_history.csv"):
            shutil.copy2(base / "recipe" / f"{label}{suffix}", recipe / f"{label}{suffix}")
    for n, stage in enumerate(stages, len(carried) + 1):
        shutil.copy2(stage / "sft_config.json", recipe / f"stage{n}_{stage.name}_config.json")
        shutil.copy2(stage / "sft_history.csv", recipe / f"stage{n}_{stage.name}_history.csv")


#: The command's stage flags, each with the run folder of the stage it adds (as a recipe labels it).
STAGE_FLAGS = (("identity-stage", "sft_identity"), ("lookup-stage", "sft_lookup"), ("zip-stage", "sft_zip_drills"),
               ("sink-stage", "sft_sink"), ("address-stage", "sft_address_drill"),
               ("payment-stage", "sft_payment_drill"), ("return-stage", "sft_return_drill"))


def recipe_flags(stages: list[tuple[str, dict, pd.DataFrame]]) -> list[str]:
    """The stage flags of ``python -m sinkflex_core.start`` that made the stages of a recipe
    (:func:`recipe_stages`), in the command's order: ``["--lookup-stage", ...]``."""
    return [f"--{flag}" for flag, stage in STAGE_FLAGS if any(label.endswith(f"_{stage}") for label, _, _ in stages)]


def recipe_stages(out: Path) -> list[tuple[str, dict, pd.DataFrame]]:
    """The SFT stages a start in ``out`` ships in its ``recipe/`` (written by :func:`_export`), first to
    last: each stage's label (``stage{n}_{run folder name}``), saved config and history. Empty when
    ``out`` has no recipe."""
    import pandas as pd

    stages = []
    for cfg_file in (out / "recipe").glob("stage*_config.json"):
        label = cfg_file.name[:-len("_config.json")]
        number = label[len("stage"):].partition("_")[0]
        hist_file = cfg_file.with_name(f"{label}_history.csv")
        if number.isdigit() and hist_file.is_file():
            stages.append((int(number), label, json.loads(cfg_file.read_text()), pd.read_csv(hist_file)))
    return [(label, cfg, hist) for _, label, cfg, hist in sorted(stages, key=lambda t: t[0])]


def measure(out: Path, test_samples: int = 8, screen_samples: int = 4, progress: bool = True,
            test_tasks: int = 0, screen_tasks: int = 0) -> None:
    """Write ``test_rewards.csv`` (the first ``test_tasks`` test tasks, 0: all; full attention and the
    preset's sink attention, or, for a start trained with sink attention, its saved attention and its
    weights under full attention, column ``attention`` ``saved`` and ``full``) and
    ``train_screen.csv`` (the first ``screen_tasks`` training tasks, 0: all; the preset's attention;
    ``screen_samples`` 0: no screen) into ``out``, each part skipped when its file already holds these
    weights, played under the current reward (``REWARD_VERSION``)."""
    import pandas as pd

    from .train import count_tasks, policy_digest, reward_version, screen_or_reuse, success_table
    from .train.evaluate import attention_label

    digest = policy_digest(out)
    # a start trained with the preset's sink attention (the sink stage) is played with its own, saved one,
    # and with its weights under full attention (as a full-attention GRPO run starts it: saved_attention=false)
    sinks = preset_sinks(out)
    plays = [(None, True), (None, False)] if sinks is None else [(None, True), (sinks, True)]
    n_test = test_tasks or count_tasks("sinkflex/Retail-v0", "test")
    path = out / "test_rewards.csv"
    old = pd.read_csv(path, dtype={"policy_digest": str}) if path.is_file() else None
    tables = []
    for settings, saved_attention in plays:
        label = attention_label(settings, saved_attention)
        if old is not None and "reward_version" in old.columns:
            part = old[(old["attention"] == label) & (old["policy_digest"] == digest) & (old["tries"] == test_samples)
                       & (old["reward_version"] == reward_version())]
            if part["task"].nunique() == n_test:
                tables.append(part)
                continue
        t0 = time.perf_counter()
        tables.append(success_table(out, "test", list(range(n_test)), test_samples, progress=progress,
                                    sinks=settings, saved_attention=saved_attention))
        mean = tables[-1]["successes"].sum() / (n_test * test_samples)
        print(f"start: test reward {mean:.3f} ({label}; {(time.perf_counter() - t0) / 60:.1f} min)",
              file=sys.stderr, flush=True)
        pd.concat(tables).to_csv(path, index=False)  # each finished part kept, should the next one be cut off
    if screen_samples:
        screen_or_reuse(out, out / "train_screen.csv", samples=screen_samples, tasks=screen_tasks,
                        progress=progress, sinks=sinks)


#: The SFT of the shipped start: the SFT defaults, stopped by a step count rather than by the clock, so
#: that the recipe gives the same policy on a busy machine as on an idle one. 1,000 steps fit in about
#: half an hour on 2 cores. Neither the identity stage nor the sink stage directly on top of it scored
#: higher on the 120 test tasks x 8 (docs/experiments.md); the sink stage after the zip rounds did
#: (:data:`SINK_STAGE_STEPS`).
RECIPE = {"max_steps": 1000, "max_minutes": 240.0}


#: Optimizer steps of the sink stage (``build(sink_stage=True)``): the last full-attention stage continued
#: with the ``tiny-cpu`` preset's sink attention, so that the start learns under the attention GRPO plays
#: it with. Switching the four zip rounds' policy to that attention untrained costs it 0.035 on the 120
#: test tasks x 8 (0.192 -> 0.157); 300 steps of the sink stage on it scored 0.220, above its 0.192 with
#: full attention, and 600 steps 0.208 (docs/experiments.md): the shipped start is the 300 steps. On the
#: one-stage start of 0.016 it had changed nothing.
SINK_STAGE_STEPS = 300


#: Rounds of the lookup stage (``build(lookup_stage=True)``), each :data:`sinkflex_core.sft.LOOKUP_STAGE`
#: on the round before, the later ones without its warm-ups: one round scored 0.044 on all 120 test
#: tasks x 8, two 0.077 (docs/experiments.md).
LOOKUP_ROUNDS = 2

#: The zip stage (``build(zip_stage=True)``), on top of the lookup rounds: recall drills in the layout of
#: the zip code's first digits (``zip 921`` in the customer's sentence, ``"zip": "921`` in the call) on
#: their own, at a rate that teaches them (the lookup stage's warm-up does not)...
ZIP_DRILLS = {"recall_fact_fillers": 1, "recall_warmup_steps": 400, "copy_warmup_length": 256, "lr": 2e-3,
              "warmup_steps": 30, "identity_warmup_steps": 0, "max_steps": 1, "eval_every": 1000}
#: ...then rounds of the lookup stage with those drills and plain ones in a quarter of the rows, which the
#: episodes' form needs to recover from the drills: 600 steps gave the zip and lost the form (2 of 240
#: episodes solved), 600 + 800 gave the form back (0.086 on all 120 test tasks x 8), 600 + 800 + 800
#: scored 0.129 against the lookup rounds' 0.076, a fourth round of 800 0.192 and a fifth 0.188
#: (docs/experiments.md): four rounds.
ZIP_ROUND = {"recall_fact_fillers": 1, "recall_plain_share": 0.5, "recall_warmup_steps": 0,
             "identity_warmup_steps": 0, "copy_warmup_length": 128, "lr": 1e-3, "warmup_steps": 10}
ZIP_ROUND_STEPS = (600, 800, 800, 800)

#: The address stage (``build(address_stage=True)``), on top of the sink stage: short rows
#: (:func:`sinkflex_core.sft_data.short_context`) cut at the calls of the two address tools and at the
#: expert's confirmations before them, drilled alone, then rounds of the sink stage with those rows beside
#: the episodes. Before it no policy had solved an address change in thousands of episodes: it could not
#: pick the street, the city or the new zip code the customer dictates.
ADDRESS_ROWS = {"action_tools": "modify_pending_order_address,modify_user_address", "action_messages": True,
                "action_confirmations": True, "short_action_rows": 4, "short_warmup_rows": 12}
#: The runs of the address stage, each continuing the one before: (optimizer steps of the drill,
#: :data:`ADDRESS_ROWS`' short rows alone as the short-row warm-up, 12 rows a step at the sink stage's lr
#: 1e-3 with its own AdamW; then steps of the sink stage with 4 short rows a step beside the episodes).
#: Teacher-forced on the oracle's episodes of the 23 address test tasks, the drill got the street's first
#: token right in none of them until step 450 and in all by 600, the city in all by 1,050, the new zip code in
#: none until 1,350 and in 18 by 2,100, while the zip code of the identity lookup was lost; the rounds gave
#: the episodes' form back (the identity zip 8 of 8) and kept every address value. On all 120 test tasks
#: x 8, one round scored 0.173 and two 0.343, against the sink stage's 0.220 (docs/experiments.md).
ADDRESS_RUNS = ((1500, 0), (600, 600), (0, 600))


#: The payment stage (``build(payment_stage=True)``), on top of the address stage and in its form: the
#: expert's confirmations of a payment change and its calls cut into short rows and drilled alone, then
#: rounds with 4 short rows a step beside the episodes, cut at the payment calls and at the two address
#: tools' (:data:`PAYMENT_ROUND_TOOLS`), so that the rounds keep the address values. The start before it
#: proposed the wrong payment method in most payment changes (the customer's "my gift card", "my paypal
#: account" or "my visa card ending in 0724", about 550 tokens back, read in 4 of the 16 test tasks'
#: confirmations).
PAYMENT_ROWS = {**ADDRESS_ROWS, "action_tools": "modify_pending_order_payment"}
PAYMENT_ROUND_TOOLS = "modify_pending_order_payment,modify_pending_order_address,modify_user_address"
#: The runs of the payment stage, as :data:`ADDRESS_RUNS`. From the address stage's start, on all 120
#: test tasks x 8 (docs/experiments.md): the payment changes went from 8 to 41 successes of 128 after the
#: drill and one round (test reward 0.343 -> 0.369), to 58 after two (0.451; the cancellations 26 -> 59).
PAYMENT_RUNS = ((600, 0), (0, 600), (0, 600))


#: The return stage (``build(return_stage=True)``), on top of the payment stage and in its form: the
#: expert's confirmations of a return and its calls drilled alone, then rounds beside the episodes with
#: short rows of the return, payment and address calls (:data:`RETURN_ROUND_TOOLS`). A return confirms
#: each item by its name and id (``I will return the Tent 1234567890 (blue) ...``), the id copied from
#: the order's record, where an item is written ``{"Tent": "1234567890", ...}``: the name two tokens before
#: the id, which a small policy's previous-token heads reach (docs/experiments.md). The payment stage's
#: start solved 1 of the 88 return episodes of the test tasks in that layout.
RETURN_ROWS = {**ADDRESS_ROWS, "action_tools": "return_delivered_order_items"}
RETURN_ROUND_TOOLS = ("return_delivered_order_items,modify_pending_order_payment,modify_pending_order_address,"
                      "modify_user_address")
#: The runs of the return stage, as :data:`ADDRESS_RUNS`. From the payment stage's start, on all 120 test
#: tasks x 8 (docs/experiments.md): the drill and one round 0.438 with 7 of 88 returns, two rounds 0.461
#: with 9 (0.450 and 1 before), 71 test tasks solved at least once (66 before).
RETURN_RUNS = ((450, 0), (0, 600), (0, 600))


def _short_row_config(name: str, rows: dict, round_tools: str, runs: tuple, n: int, base_dir: str | Path,
                      work_dir: str | Path, **run):
    drill, steps = runs[n]
    out = Path(work_dir) / (f"sft_{name}_drill" if n == 0 else f"sft_{name}{n}")
    tools = {"action_tools": round_tools} if n else {}
    return sink_stage_config(base_dir, out, **run, **{**rows, **tools}, short_warmup_steps=drill, max_steps=steps,
                             eval_every=max(1, steps))


def address_config(n: int, base_dir: str | Path, work_dir: str | Path, **run):
    """The :class:`~sinkflex_core.sft.SFTConfig` of run ``n`` of :data:`ADDRESS_RUNS`, continuing the
    policy in ``base_dir`` (the sink stage, or the run before; with ``sinkflex_sinks.json``) into
    ``work_dir/sft_address_drill`` (run 0, the drill alone: ``max_steps`` 0) or ``work_dir/sft_addressN``;
    ``run``: how it runs (threads, device, progress)."""
    return _short_row_config("address", ADDRESS_ROWS, ADDRESS_ROWS["action_tools"], ADDRESS_RUNS, n, base_dir,
                             work_dir, **run)


def payment_config(n: int, base_dir: str | Path, work_dir: str | Path, **run):
    """The :class:`~sinkflex_core.sft.SFTConfig` of run ``n`` of :data:`PAYMENT_RUNS`, as
    :func:`address_config`: ``work_dir/sft_payment_drill`` (:data:`PAYMENT_ROWS`' payment rows alone), then
    ``work_dir/sft_paymentN`` (short rows of :data:`PAYMENT_ROUND_TOOLS` beside the episodes)."""
    return _short_row_config("payment", PAYMENT_ROWS, PAYMENT_ROUND_TOOLS, PAYMENT_RUNS, n, base_dir, work_dir,
                             **run)


def return_config(n: int, base_dir: str | Path, work_dir: str | Path, **run):
    """The :class:`~sinkflex_core.sft.SFTConfig` of run ``n`` of :data:`RETURN_RUNS`, as
    :func:`payment_config`: ``work_dir/sft_return_drill`` (:data:`RETURN_ROWS`' return rows alone), then
    ``work_dir/sft_returnN`` (short rows of :data:`RETURN_ROUND_TOOLS` beside the episodes)."""
    return _short_row_config("return", RETURN_ROWS, RETURN_ROUND_TOOLS, RETURN_RUNS, n, base_dir, work_dir, **run)


def sink_stage_config(base_dir: str | Path, out_dir: str | Path, **overrides):
    """The :class:`~sinkflex_core.sft.SFTConfig` of the sink stage: the saved config of the SFT run in
    ``base_dir``, continued from it (``init_from``) for :data:`SINK_STAGE_STEPS` steps with the sink
    attention a ``tiny-cpu`` run plays it with (:func:`sink_settings` of ``base_dir``: its
    ``sinkflex_sinks.json``, :func:`estimate_sinks`, or the counts a sink-attention run there trained
    with), writing to ``out_dir``; ``overrides`` last."""
    from . import sft

    values = sft.saved_config(base_dir)
    # one evaluation, at the end: the stage's last weights are kept (40 validation episodes cannot tell
    # two checkpoints of one stage apart)
    steps = {"max_steps": SINK_STAGE_STEPS, "eval_every": SINK_STAGE_STEPS}
    # the stage trains from the last stage's weights: no new warm-ups of the stages before it
    values.update(steps, identity_warmup_steps=0, recall_warmup_steps=0, init_from=str(base_dir),
                  out_dir=str(out_dir), attention="sinkflex", **sink_settings(base_dir))
    values.update(overrides)
    return sft.SFTConfig(**values)


def check_base(base: Path, asked: list[str]) -> None:
    """Raise ``ValueError`` unless ``base`` is a saved start that the stage flags ``asked`` can continue:
    each of them a stage after the last of the stages it was made with."""
    for name in ("model.safetensors", "sft_config.json"):
        if not (base / name).is_file():
            raise ValueError(f"{base} is not a saved start: it has no {name}")
    flags = [f"--{flag}" for flag, _ in STAGE_FLAGS]
    made = recipe_flags(recipe_stages(base))
    last = max((flags.index(f) for f in made), default=-1)
    early = [f for f in asked if flags.index(f) <= last]
    if early:
        raise ValueError(f"{base} was made with {' '.join(made)}: a start continued from it takes only the stages "
                         f"after those, not {' '.join(early)}")


def build(out: str | Path | None = None, work_dir: str | Path = "runs/start", threads: int = 0,
          test_samples: int = 8, screen_samples: int = 4, progress: bool = True,
          identity_stage: bool = False, sink_stage: bool = False, lookup_stage: bool = False,
          zip_stage: bool = False, address_stage: bool = False, payment_stage: bool = False,
          return_stage: bool = False, device: str = "auto", base: str | Path | None = None) -> Path:
    """Train (or reuse) the SFT in ``work_dir`` (and, with ``identity_stage``, its second stage,
    :data:`sinkflex_core.sft.IDENTITY_STAGE`; with ``lookup_stage``, :data:`LOOKUP_ROUNDS` rounds of the
    stage that drills every lookup of a tool call's values, :data:`sinkflex_core.sft.LOOKUP_STAGE`; with ``zip_stage``, the zip code's drills
    :data:`ZIP_DRILLS` and the rounds :data:`ZIP_ROUND` after them; with ``sink_stage``, a last stage on the ``tiny-cpu``
    preset's sink attention, :func:`sink_stage_config`, whose sink counts are estimated on the stage before;
    with ``address_stage``, then the address calls' drill and rounds, :func:`address_config`, on those counts;
    with ``payment_stage``, then the payment calls' drill and rounds, :func:`payment_config`; with
    ``return_stage``, then the return calls' drill and rounds, :func:`return_config`),
    copy the policy to ``out`` (default: :func:`start_dir`), estimate its sinks (a sink stage keeps the
    counts it trained with), measure it (``screen_samples`` 0: not the training tasks) and write its
    model card. ``device`` is where every stage trains (:attr:`sinkflex_core.sft.SFTConfig.device`; the
    measurement plays on the CPU). With ``base``, a saved start (e.g. the shipped one), the stages
    continue from it instead of training the ones before (only the stages after its own may be asked;
    its recipe is carried into ``out``'s). Returns ``out``."""
    from . import attention, sft

    out = Path(out) if out is not None else start_dir()
    work = Path(work_dir)
    run = dict(zip(sft.RUN_FIELDS, (threads, device, progress), strict=True))  # how each stage runs
    if base is not None:
        base = Path(base)
        if base.resolve() == out.resolve():
            raise ValueError(f"a start continued from {base} goes to another folder (out)")
        check_base(base, [f"--{flag}" for (flag, _), wanted in zip(STAGE_FLAGS, (
            identity_stage, lookup_stage, zip_stage, sink_stage, address_stage, payment_stage, return_stage),
            strict=True) if wanted])
    stages = [base] if base is not None else [sft.train_or_reuse(sft.SFTConfig(out_dir=str(work / "sft"), **run,
                                                                                **RECIPE))]
    if identity_stage:
        stages.append(sft.train_or_reuse(sft.identity_stage(stages[0], work / "sft_identity", **run)))
    if lookup_stage:  # twice: the second round without the warm-ups (docs/experiments.md)
        for n in range(LOOKUP_ROUNDS):
            again = {"recall_warmup_steps": 0, "identity_warmup_steps": 0} if n else {}
            stages.append(sft.train_or_reuse(sft.lookup_stage(stages[-1], work / f"sft_lookup{n + 1 if n else ''}",
                                                              **run, **again)))
    if zip_stage:
        stages.append(sft.train_or_reuse(sft.lookup_stage(stages[-1], work / "sft_zip_drills", **run, **ZIP_DRILLS)))
        for n, steps in enumerate(ZIP_ROUND_STEPS):
            stages.append(sft.train_or_reuse(sft.lookup_stage(stages[-1], work / f"sft_zip{n + 1}", **run,
                                                              max_steps=steps, eval_every=steps, **ZIP_ROUND)))
    if sink_stage:
        if not (stages[-1] / attention.SINKS_FILENAME).is_file():
            estimate_sinks(stages[-1])
        stages.append(sft.train_or_reuse(sink_stage_config(stages[-1], work / "sft_sink", **run)))
        (stages[-1] / attention.SINKS_FILENAME).write_bytes((stages[-2] / attention.SINKS_FILENAME).read_bytes())
    for wanted, config, runs in ((address_stage, address_config, ADDRESS_RUNS),
                                 (payment_stage, payment_config, PAYMENT_RUNS),
                                 (return_stage, return_config, RETURN_RUNS)):
        if not wanted:
            continue
        if not (stages[-1] / attention.SINKS_FILENAME).is_file():
            estimate_sinks(stages[-1])
        counts = (stages[-1] / attention.SINKS_FILENAME).read_bytes()
        for n in range(len(runs)):  # each config read from the saved config of the run before it
            stages.append(sft.train_or_reuse(config(n, stages[-1], work, **run)))
            (stages[-1] / attention.SINKS_FILENAME).write_bytes(counts)  # the counts every run trained with
    _export(stages[-1], out, stages[1:] if base is not None else stages, base)
    if not (sink_stage or address_stage or payment_stage or return_stage or base is not None):
        estimate_sinks(out)
    measure(out, test_samples, screen_samples, progress)
    write_card(out)
    return out


# ---- the model card ---------------------------------------------------------------------------------

def _interval(successes, tries, draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean success rate and a 95 % bootstrap interval over tasks (tasks resampled)."""
    import numpy as np

    from .train.evaluate import bootstrap_mean

    return bootstrap_mean(np.asarray(successes, float) / np.asarray(tries, float), draws, seed)


def measured_rewards(folder: str | Path | None = None):
    """The test rewards recorded in ``folder``'s ``test_rewards.csv`` (default: :func:`start_dir`), one row
    per attention: ``attention``, ``reward`` (mean over every episode), ``low`` and ``high`` (95 % bootstrap
    interval, test tasks resampled), ``tasks``, ``episodes_per_task``, ``minutes``, ``git_sha``."""
    import pandas as pd

    folder = Path(folder) if folder is not None else start_dir()
    tests = pd.read_csv(folder / "test_rewards.csv", dtype={"git_sha": str, "policy_digest": str})
    rows = []
    for label, t in tests.groupby("attention", sort=False):
        mean, lo, hi = _interval(t["successes"], t["tries"])
        rows.append({"attention": label, "reward": mean, "low": lo, "high": hi, "tasks": t["task"].nunique(),
                     "episodes_per_task": int(t["tries"].iloc[0]), "minutes": float(t["minutes"].iloc[0]),
                     "git_sha": t["git_sha"].iloc[0]})
    return pd.DataFrame(rows)


def _play_words(label: str, saved_attention: dict | None) -> str:
    """The attention a play of the start used (its ``attention`` column: ``saved``, ``full`` or a sink
    attention's label from :func:`sinkflex_core.train.attention_label`), in words for the card."""
    if label == "saved":
        return "full attention" if saved_attention is None else "its saved sink attention"
    return "its weights under full attention" if label == "full" else f"sink attention {label}"


def card_text(out: Path) -> str:
    """The model card of the start in ``out``, from the files there."""
    import pandas as pd
    from safetensors import safe_open

    from . import attention
    from .train import policy_digest

    shape = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    lines = ["# retail-tiny-start: the start policy of the small-scale reproduction", "",
             "A tiny Qwen2 causal LM trained from scratch on the retail oracle's episodes "
             "(`sinkflex/Retail-v0`), the policy GRPO's `tiny-cpu` preset starts from, as the paper's runs "
             "start from Qwen2.5-7B-Instruct. It plays the store's customer-service agent: tool calls as "
             "`<tool_call>{...}</tool_call>`, the compact system prompt of the SFT recipe, episodes up to "
             "2,048 tokens.", "",
             "## Model", "",
             f"- Architecture: Qwen2, hidden size {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
             f"{shape['num_attention_heads']} attention heads ({shape['num_key_value_heads']} key-value heads), "
             f"vocabulary {shape['vocab_size']:,} (a BPE tokenizer trained on the store's texts, in this folder); "
             f"{params:,} parameters, float32.",
             f"- Weights digest (first 16 hex digits of the SHA-256 of `model.safetensors`): `{policy_digest(out)}`.",
             "- " + _attention_sentence(out) + " " + _sinks_sentence(out) + ".",
             "", "## Recipe and data", ""]
    total_tokens = 0
    stages = recipe_stages(out)
    for label, cfg, hist in stages:
        warm = cfg.get("copy_warmup_steps", 0) if not cfg.get("init_from") else 0
        warm += cfg.get("identity_warmup_steps", 0) + cfg.get("recall_warmup_steps", 0)
        # a short-row warm-up with its own row count (the address drill) is counted in rows, not tokens
        short, short_rows = cfg.get("short_warmup_steps", 0), cfg.get("short_warmup_rows", 0)
        if not short_rows:
            warm += short
        steps = int(hist["step"].max()) if len(hist) else 0
        tokens = (steps + warm) * cfg["batch_tokens"]
        total_tokens += tokens
        text = f"- `{label}`: "
        if short and short_rows:
            tools = ", ".join(t for t in cfg.get("action_tools", "").split(",") if t) or "every later call"
            text += f"{short:,} drill steps of {short_rows} short rows cut at the calls of {tools}, then "
        if warm or not (short and short_rows):
            text += f"{warm:,} warm-up steps and "
        text += (f"{steps:,} SFT step{'s' if steps != 1 else ''} of {cfg['batch_tokens']:,} padded tokens "
                 f"({tokens / 1e6:.1f}M tokens)" if steps else "no SFT step") + f", lr {cfg['lr']}"
        if len(hist):
            best = hist[hist["best"]].iloc[-1] if "best" in hist and hist["best"].any() else hist.iloc[-1]
            text += (f", {hist['elapsed_s'].max() / 60:.1f} minutes of SFT after the warm-up; the weights of step "
                     f"{int(best['step'])} kept (validation reward {best['val_reward']:.3f}, "
                     f"{cfg['val_tasks']} training-split tasks never in the data).")
        else:
            text += "; the weights at the end of the drill kept (no evaluation)."
        lines.append(text)
    drilled = any(c.get("short_warmup_steps") and c.get("short_warmup_rows") for _, c, _ in stages)
    lines += [f"- About {total_tokens / 1e6:.0f}M tokens seen in all"
              + (" besides the drills' short rows" if drilled else "") + ". Data: the oracle's episodes of the "
              "10,000 synthetic retail tasks (users of the training split, apart from GRPO's 600 training "
              "tasks and the 120 test tasks), people and places renamed per episode, copy drills in the "
              "batches (`sinkflex_core.sft` documents each ingredient).",
              "- What was tried on the way, and what did not help: `docs/experiments.md`.", "",
              "## Measured", ""]
    tests = pd.read_csv(out / "test_rewards.csv", dtype={"git_sha": str, "policy_digest": str})
    saved_attention = attention.attention_settings(out)
    solved = None
    for label, t in tests.groupby("attention", sort=False):
        mean, lo, hi = _interval(t["successes"], t["tries"])
        row = t.iloc[0]
        if solved is None:  # the kinds of the first play (its own attention)
            by_kind = t.groupby("kind")["successes"].sum()
            solved = ([k for k, v in by_kind.items() if v > 0], [k for k, v in by_kind.items() if v == 0])
        lines.append(f"- Test reward with {_play_words(label, saved_attention)}: **{mean:.3f}** (95 % bootstrap interval over tasks "
                     f"{lo:.3f}-{hi:.3f}), all {t['task'].nunique()} test tasks x {int(row['tries'])} episodes, "
                     f"temperature 1; {row['minutes']} minutes on {row['hardware']}, commit {row['git_sha']}.")
        kinds = t.groupby("kind")["successes"].sum() / t.groupby("kind")["tries"].sum()
        lines.append("  By request kind: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()) + ".")
    screen_path = out / "train_screen.csv"
    if screen_path.is_file():
        screen = pd.read_csv(screen_path, dtype={"git_sha": str, "policy_digest": str})
        some = int(((screen["successes"] > 0) & (screen["successes"] < screen["tries"])).sum())
        played = _play_words(screen["attention"].iloc[0], saved_attention)
        lines.append(f"- Training tasks solved sometimes but not always ({int(screen['tries'].iloc[0])} episodes "
                     f"each, {played}): {some} of {len(screen)}; the screen GRPO trains on "
                     "(`train_screen.csv`).")
    done, never = solved or ([], [])
    lines += ["- The paper's start, Qwen2.5-7B-Instruct, scores 0.25 on its retail tasks. This policy has "
              "learned the conversations' form and the tool calls; it solves test tasks of "
              f"{len(done)} of the {len(done) + len(never)} request kinds above ({', '.join(done) or 'none'}; "
              "`docs/experiments.md` says what limits a model trained from scratch here). The two numbers "
              "are of different models on different task sets, not comparable as a percentage.",
              "",
              "## Regenerate", "", "```", " ".join(["python -m sinkflex_core.start", *recipe_flags(stages)]),
              "```", "",
              "It generates the oracle's expert episodes and runs the copy warm-up (together about a quarter "
              "of an hour on 2 cores), the SFT and the measurements above, whose minutes each line gives "
              "(measured on a shared machine: idle cores are faster). Finished parts are reused when run "
              "again; `--card-only` rewrites this card from the files in the folder, and `--measure-only` "
              "measures the start again where its files were made under an earlier reward version, then "
              "rewrites the card.", "",
              "## Use", "", "```python", "from sinkflex_core import models, start",
              "policy = models.load_policy(start.start_dir())",
              "tokenizer = models.load_tokenizer(start.start_dir())", "```", "",
              "Load the tokenizer with `models.load_tokenizer`, not `AutoTokenizer.from_pretrained`: for a "
              "folder whose `config.json` says `qwen2`, transformers 5 builds a `Qwen2Tokenizer` with its "
              "own pre-tokenizer, which splits numbers into single digits where this folder's "
              "`tokenizer.json` keeps groups of three, so the policy would be fed tokens it never saw "
              "(`models.load_tokenizer` loads `tokenizer.json` as saved when the two differ).", "",
              "GRPO from it: `sinkflex train --model data/retail-tiny-start` (preset `tiny-cpu`, which plays "
              "it with the sink attention above) or `python benchmarks/reproduce_curve.py`.", ""]
    return "\n".join(lines)


def _attention_sentence(out: Path) -> str:
    """Which attention the policy in ``out`` was trained with, from its saved attention settings, and
    where its sink counts come from (the sentence ends where :func:`_sinks_sentence` goes on)."""
    from . import attention

    settings = attention.attention_settings(out)
    if settings is None:
        return ("Trained with full causal attention (sdpa). `sinkflex_sinks.json` holds the per-layer sink counts "
                "estimated from it (`sinkflex_core.attention.estimate_layer_sinks`), which GRPO's sink attention "
                "uses:")
    learned = "with" if settings["learn_sinks"] else "without"
    return (f"Trained (its last SFT stage) with sink attention: a window of {settings['window']} keys, "
            f"{learned} the learned zero-value sink logits (saved with the weights; `models.load_policy` "
            "restores them), and the per-layer sink counts of `sinkflex_sinks.json`, estimated on the stage "
            "before with full attention (`sinkflex_core.attention.estimate_layer_sinks`) and used by GRPO's sink "
            "attention too:")


def _sinks_sentence(out: Path) -> str:
    data = json.loads((out / "sinkflex_sinks.json").read_text())
    peak = max(max(m) for m in data["mass"])
    text = (f"{', '.join(str(n) for n in data['n_sink'])} sink tokens in layers 0-{len(data['n_sink']) - 1} "
            f"(at least {data['min_sinks']}; a position is a sink when queries put at least "
            f"{data['threshold']:.0%} of their attention on it)")
    if all(n == data["min_sinks"] for n in data["n_sink"]):
        text += (f"; no early position of any layer drew more than {peak:.1%} of the attention, so every layer "
                 "keeps the minimum")
    return text


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def write_card(out: str | Path) -> Path:
    """Write ``README.md``, the model card, into ``out``."""
    path = Path(out) / "README.md"
    path.write_text(card_text(Path(out)))
    return path


def main(argv: list[str] | None = None) -> int:
    from .provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    p = argparse.ArgumentParser(prog="python -m sinkflex_core.start", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="where the start goes (default: data/retail-tiny-start; a folder "
                                               "holding a start made with other stage flags is refused)")
    p.add_argument("--work-dir", default="runs/start", help="where the SFT stages train (reused when run again)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="auto", help="where the SFT stages train: auto (a GPU when torch sees one), "
                                                    "cpu, cuda or cuda:N (the measurement plays on the CPU)")
    p.add_argument("--test-samples", type=int, default=8, help="episodes per test task")
    p.add_argument("--screen-samples", type=int, default=4, help="episodes per training task in the screen (0: none)")
    p.add_argument("--identity-stage", action="store_true", help="continue the SFT with its identity stage")
    p.add_argument("--lookup-stage", action="store_true",
                   help="continue the SFT with the stage that drills every lookup of a tool call's values")
    p.add_argument("--zip-stage", action="store_true",
                   help="then drill the zip code's lookup and recover the episodes in four rounds")
    p.add_argument("--sink-stage", action="store_true",
                   help=f"end the SFT with {SINK_STAGE_STEPS} steps on the tiny-cpu preset's sink attention")
    p.add_argument("--address-stage", action="store_true",
                   help="then drill the address calls' values and recover the episodes in rounds, on the preset's "
                        "sink attention")
    p.add_argument("--payment-stage", action="store_true",
                   help="then drill the payment method the customer names and recover the episodes in rounds, "
                        "on the preset's sink attention")
    p.add_argument("--return-stage", action="store_true",
                   help="then drill the return of the items the customer names and recover the episodes in "
                        "rounds, on the preset's sink attention")
    p.add_argument("--from", dest="base", default=None, metavar="FOLDER",
                   help="continue a saved start (e.g. data/retail-tiny-start) with the stages asked after its "
                        "own, instead of training from scratch")
    p.add_argument("--card-only", action="store_true", help="only rewrite README.md from the folder's files")
    p.add_argument("--measure-only", action="store_true",
                   help="train nothing: measure the start in the folder again where its files were made with "
                        "other weights or under an earlier reward version, then rewrite README.md")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    # checked first: the measurement that reads them comes after the SFT stages (hours)
    if args.test_samples < 1:
        p.error(f"--test-samples must be >= 1, got {args.test_samples}")
    if args.screen_samples < 0:
        p.error(f"--screen-samples must be >= 0 (0: no screen), got {args.screen_samples}")
    from .sft import SFTConfig
    from .train.config import ConfigError

    try:  # a device this machine lacks, before the expert episodes are made
        SFTConfig(device=args.device).torch_device()
    except ConfigError as err:
        p.error(f"--device: {err}")
    asked = [f"--{flag}" for flag, _ in STAGE_FLAGS if getattr(args, flag.replace("-", "_"))]
    if args.base:  # before the hours of training
        try:
            check_base(Path(args.base), asked)
        except ValueError as err:
            p.error(f"--from: {err}")
    if args.card_only:
        print(write_card(Path(args.out) if args.out else start_dir()))
        return 0
    out_dir = Path(args.out) if args.out else start_dir()
    if args.no_progress:
        from . import models

        models.hide_loading_bars()
    if args.measure_only:
        if not (out_dir / "model.safetensors").is_file():
            p.error(f"{out_dir} holds no policy (model.safetensors) to measure")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        measure(out_dir, args.test_samples, args.screen_samples, progress=not args.no_progress)
        print(write_card(out_dir))
        return 0
    if (out_dir / "model.safetensors").is_file() and (out_dir / "recipe").is_dir():
        made_by = recipe_flags(recipe_stages(out_dir))
        if args.base:
            asked = recipe_flags(recipe_stages(Path(args.base))) + asked
        if asked != made_by:  # hours of training that would end by replacing another start
            p.error(f"{out_dir} holds a start made with {' '.join(made_by) or 'no stage flag'}; these flags "
                    f"({' '.join(asked) or 'none'}) would replace it with another: give --out a new folder "
                    f"(e.g. --out runs/start/policy), or the same flags to regenerate it")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = build(args.out, args.work_dir, args.threads, args.test_samples, args.screen_samples,
                progress=not args.no_progress, identity_stage=args.identity_stage, sink_stage=args.sink_stage,
                lookup_stage=args.lookup_stage, zip_stage=args.zip_stage, address_stage=args.address_stage,
                payment_stage=args.payment_stage, return_stage=args.return_stage, device=args.device,
                base=args.base)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
