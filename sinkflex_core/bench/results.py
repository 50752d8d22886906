"""The VRAM harness's results, read back for the notebooks and the README: every ``data/vram_*.csv``,
the paper's claims (``data/paper_claims.csv``) beside our measurements, and the Markdown table that
``sinkflex bench results --readme README.md`` writes."""

from __future__ import annotations

import argparse
import glob
import math
import sys
from pathlib import Path

from .step import COLUMNS


def load_vram_results(folder: Path | None = None):
    """Every ``data/vram_*.csv`` as one DataFrame, with ``file`` (its name) and ``recorded`` (True for
    the transcribed ``vram_recorded_*.csv`` measurements) columns; empty if there is none."""
    import pandas as pd

    from ..paths import data_dir

    folder = Path(folder) if folder else data_dir()
    frames = []
    for path in sorted(folder.glob("vram_*.csv")):
        df = pd.read_csv(path)
        if df.empty:
            continue
        df["file"] = path.name
        df["recorded"] = path.name.startswith("vram_recorded")
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=[*COLUMNS, "file", "recorded"])
    df = pd.concat(frames, ignore_index=True)
    for col in ("tokens", "peak_gib", "step_s", "tokens_per_s", "peak_reserved_gib"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    return df


def load_paper_claims(folder: Path | None = None):
    """``data/paper_claims.csv`` as a DataFrame (empty if missing)."""
    import pandas as pd

    from ..paths import data_dir

    path = (Path(folder) if folder else data_dir()) / "paper_claims.csv"
    return pd.read_csv(path) if path.exists() else pd.DataFrame()


def case_label(row) -> str:
    label = f"{row['attention']} · {row['logprobs']} logprobs · {row['mlp']} mlp"
    if "recorded" in row and bool(row["recorded"]):
        label += " (recorded)"
    return label


def ratio_table(results, paper):
    """For each measured case at each length where the paper has a point, our peak and the ratio
    to the paper's standard and SINKFLEX numbers. Columns: case, tokens, ours_gib, paper_standard,
    paper_sinkflex, vs_standard, vs_sinkflex, source."""
    import pandas as pd

    rows = []
    if results is None or not len(results) or paper is None or not len(paper):
        return pd.DataFrame(rows)
    vram = paper[paper["quantity"] == "peak_vram"]
    for tokens, grp in vram.groupby("tokens"):
        std = grp[grp["setting"].str.contains("standard")]["value"]
        snk = grp[grp["setting"].str.contains("SINKFLEX")]["value"]
        std = float(std.iloc[0]) if len(std) and pd.notna(std.iloc[0]) else math.nan
        snk = float(snk.iloc[0]) if len(snk) and pd.notna(snk.iloc[0]) else math.nan
        ours = results[(results["tokens"] == tokens) & (results["status"] == "ok")]
        for _, r in ours.iterrows():
            rows.append({"case": case_label(r), "tokens": int(tokens), "ours_gib": round(r["peak_gib"], 2),
                         "paper_standard": std, "paper_sinkflex": snk,
                         "vs_standard": round(r["peak_gib"] / std, 3) if std == std else math.nan,
                         "vs_sinkflex": round(r["peak_gib"] / snk, 3) if snk == snk else math.nan,
                         "source": r["file"]})
    return pd.DataFrame(rows)


def _match_measurement(claim, folder: Path):
    """Our number for one paper claim, found as the claim row says (``match_files``: globs under
    ``data/``, first file that matches wins; ``match_query``: a pandas query; ``match_column``).
    Returns ``(value, hardware, file)`` or None."""
    import pandas as pd

    files = str(claim.get("match_files", "") or "")
    query = str(claim.get("match_query", "") or "")
    column = str(claim.get("match_column", "") or "")
    if not files or files == "nan" or not column or column == "nan":
        return None
    for pattern in files.split(";"):
        for path in sorted(glob.glob(str(folder / pattern.strip()))):
            try:
                df = pd.read_csv(path)
                if column in df:  # e.g. evaluation rows only, before "step == step.max()"
                    df = df[df[column].notna()]
                if query and query != "nan":
                    df = df.query(query)
            except Exception:  # a file of another shape: not the one this claim is about
                continue
            if column == "status_oom":
                if "status" in df:
                    # only a case that ran (or was skipped because a shorter length of it ran out of
                    # memory) tells whether it fits: one skipped for the time budget or after a timeout,
                    # timed out, failed or unavailable says nothing
                    note = df["note"].astype(str) if "note" in df else ""
                    df = df[df["status"].isin(["ok", "oom"])
                            | (df["status"].eq("skipped") & note.str.contains("ran out of memory", regex=False))]
                if len(df):
                    r = df.iloc[0]
                    value = "OOM" if r["status"] in ("oom", "skipped") else f"fits ({float(r['peak_gib']):.2f} GiB)"
                    return value, str(r.get("gpu", "")), Path(path).name
                continue
            if column not in df or not len(df):
                continue
            values = pd.to_numeric(df[column], errors="coerce").dropna()
            if len(values):
                hw = str(df["gpu"].iloc[0]) if "gpu" in df else str(df.get("hardware", pd.Series([""])).iloc[0])
                return float(values.mean()), hw, Path(path).name
    return None


def paper_vs_ours(folder: Path | None = None):
    """The side-by-side table: each claim of ``data/paper_claims.csv``, our measurement from
    ``data/`` ("not measured yet" where nothing matches), the hardware, and the gap.

    A claim whose ``match_column`` is ``ratio:A/B`` is the relative change from claim A's
    measurement to claim B's (in %), and one with ``diff:A/B`` the difference B - A, both computed
    from our two numbers. A claim with ``compare`` = ``no`` (a result of another model scale than the
    paper's) gets no gap: the two numbers stand side by side."""
    import pandas as pd

    from ..paths import data_dir

    folder = Path(folder) if folder else data_dir()
    claims = load_paper_claims(folder)
    found_by_id: dict[str, tuple] = {}
    rows = []
    for _, c in claims.iterrows():
        column = str(c.get("match_column", "") or "")
        kind, _, pair = column.partition(":")
        if kind in ("ratio", "diff") and pair:
            a, b = pair.split("/")
            if a in found_by_id and b in found_by_id and not isinstance(found_by_id[a][0], str) \
                    and not isinstance(found_by_id[b][0], str):
                va, vb = found_by_id[a][0], found_by_id[b][0]
                change = 100.0 * (vb / va - 1.0) if kind == "ratio" else vb - va
                files = found_by_id[a][2] if found_by_id[a][2] == found_by_id[b][2] \
                    else f"{found_by_id[a][2]} + {found_by_id[b][2]}"
                found = (change, found_by_id[b][1], files)
            else:
                found = None
        else:
            found = _match_measurement(c, folder)
        if found:
            found_by_id[str(c["claim_id"])] = found
        paper_oom = pd.isna(c["value"])
        unit = str(c["unit"]) if pd.notna(c["unit"]) else ""
        row = {"claim": c["claim"], "paper": "OOM" if paper_oom else f"{c['value']:g} {unit}".strip(),
               "paper_hardware": c["hardware"], "ours": "not measured yet", "our_hardware": "", "gap": "",
               "from": ""}
        if found:
            value, hw, fname = found
            row.update(our_hardware=hw, **{"from": fname})
            if isinstance(value, str):
                row["ours"] = value
                row["gap"] = "same outcome" if (value == "OOM") == paper_oom else "differs: paper OOM, ours fits"
            elif str(c.get("compare", "yes")).strip().lower() == "no":
                # e.g. a 1.6M-parameter policy trained on a CPU beside the paper's 7B model: the numbers
                # stand side by side, and a difference or a percentage between them would mean nothing
                our_unit = str(c.get("our_unit", "") or "")
                sign = "+" if kind == "diff" else ""
                row["ours"] = f"{value:{sign}.2f} {our_unit if our_unit != 'nan' else ''}".strip()
                row["gap"] = "not compared: other model scale"
            else:
                our_unit = str(c.get("our_unit", "") or "")
                sign = "+" if kind == "diff" else ""
                row["ours"] = f"{value:{sign}.2f} {our_unit if our_unit != 'nan' else ''}".strip()
                if paper_oom:
                    row["gap"] = "paper: OOM; ours fits"
                elif unit == "%":
                    row["gap"] = f"{value - float(c['value']):+.1f} points"
                else:
                    gap = value - float(c["value"])
                    row["gap"] = f"{gap:+.2f} ({value / float(c['value']) - 1:+.1%})"
        rows.append(row)
    return pd.DataFrame(rows)


RESULTS_BEGIN = "<!-- results: made by `sinkflex bench results --readme README.md`; do not edit by hand -->"
RESULTS_END = "<!-- results: end -->"


def results_markdown(folder: Path | None = None) -> str:
    """:func:`paper_vs_ours` as a Markdown table (the README's "Results" block)."""
    table = paper_vs_ours(folder)
    lines = ["| claim | paper | ours | gap | our hardware | data |", "|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        cells = [r["claim"], f"{r['paper']} ({r['paper_hardware']})", r["ours"], r["gap"], r["our_hardware"],
                 f"`{r['from']}`" if r["from"] else ""]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def readme_with_results(text: str, folder: Path | None = None) -> str:
    """``text`` (a README) with the lines between :data:`RESULTS_BEGIN` and :data:`RESULTS_END`
    replaced by :func:`results_markdown`; ValueError if the markers are missing."""
    start, end = text.find(RESULTS_BEGIN), text.find(RESULTS_END)
    if start < 0 or end < start:
        raise ValueError(f"no results block: put the lines {RESULTS_BEGIN!r} and {RESULTS_END!r} where the "
                         "table goes")
    return text[:start + len(RESULTS_BEGIN)] + "\n" + results_markdown(folder) + "\n" + text[end:]


def results_main(argv: list[str]) -> int:
    """``sinkflex bench results [--readme README.md]``: print the paper-vs-ours table, or rewrite the
    README's block with it."""
    parser = argparse.ArgumentParser(prog="sinkflex bench results",
                                     description="The paper's claims beside our measurements in data/, as Markdown.")
    parser.add_argument("--data", type=Path, default=None, help="the data folder (default: the project's data/)")
    parser.add_argument("--readme", type=Path, default=None,
                        help="rewrite this file's results block instead of printing the table")
    args = parser.parse_args(argv)
    # without the claims the table is empty, and --readme would wipe the README's block with it
    if args.data is not None and not (args.data / "paper_claims.csv").is_file():
        print(f"sinkflex bench results: no paper_claims.csv in --data {str(args.data)!r}", file=sys.stderr)
        return 2
    if args.readme is None:
        print(results_markdown(args.data))
        return 0
    try:
        text = args.readme.read_text()
        new = readme_with_results(text, args.data)
    except (OSError, ValueError) as err:
        print(f"sinkflex bench results: {args.readme}: {err}", file=sys.stderr)
        return 2
    if new != text:
        args.readme.write_text(new)
    print(f"{args.readme}: results block {'rewritten' if new != text else 'already up to date'}")
    return 0


def step_rows(results):
    """Only the rows that measure a whole training step (not the attention-alone or weights-alone
    rows that ``vram_recorded_*.csv`` also carries)."""
    if "measurement" not in results:
        return results
    keep = results["measurement"].isna() | results["measurement"].isin(["lora_step", "grpo_step"])
    return results[keep & results["tokens"].notna()]


def targets_report(results):
    """The memory and speed targets against what ``results`` (GPU rows, capped at 80 GiB) hold: one row per
    target with the measured value or "not measured yet"."""
    import pandas as pd

    gpu = step_rows(results)
    gpu = gpu[gpu["memory_metric"].astype(str).str.startswith("cuda")] if len(gpu) else gpu
    fresh = gpu[~gpu["recorded"]] if len(gpu) else gpu

    def pick(df, attention, logprobs, mlp, tokens):
        sel = df[(df["attention"] == attention) & (df["logprobs"] == logprobs) & (df["mlp"] == mlp)
                 & (df["tokens"] == tokens) & (df["status"] == "ok")]
        return sel.iloc[0] if len(sel) else None

    rows = []
    r = pick(fresh, "sinkflex", "chunked", "plain", 8192) if len(fresh) else None
    rows.append({"target": "sinkflex + memory-light log-probs at 8,192 tokens <= 18.5 GiB",
                 "measured": f"{r['peak_gib']:.2f} GiB" if r is not None else "not measured yet",
                 "met": ("yes" if r["peak_gib"] <= 18.5 else "no") if r is not None else ""})
    longest = ""
    met = ""
    if len(fresh):
        fits = fresh[(fresh["status"] == "ok") & (fresh["peak_gib"] <= 80)]
        # the cap in force: run_case records the whole card where it is smaller than --cap-gib 80 (an
        # 80 GB H100 is ~79.2 GiB), a cap stricter than 80 GiB, which the target allows as well
        capped = fits[pd.to_numeric(fits["cap_gib"], errors="coerce") <= 80] if "cap_gib" in fits else fits
        if len(capped):
            best = capped.sort_values(["tokens", "peak_gib"], ascending=[False, True]).iloc[0]
            longest = f"{int(best['tokens'])} tokens ({best['case']}, {best['peak_gib']:.2f} GiB)"
            met = "yes" if best["tokens"] >= 131072 else "no"
    rows.append({"target": "longest trajectory under the 80 GiB cap: 131,072 tokens",
                 "measured": longest or "not measured yet", "met": met})
    for tokens, need, what in ((8192, 1.0, "no slower than stock sdpa"), (65536, 2.0, "at least 2x faster than sdpa"),
                               (131072, 2.0, "at least 2x faster than sdpa")):
        mlp = "plain" if tokens <= 8192 else "tiled"
        a = pick(fresh, "sdpa", "chunked", mlp, tokens) if len(fresh) else None
        b = pick(fresh, "sinkflex", "chunked", mlp, tokens) if len(fresh) else None
        if a is not None and b is not None:
            speedup = a["step_s"] / b["step_s"]
            rows.append({"target": f"step time at {tokens:,} tokens: {what}",
                         "measured": f"sdpa {a['step_s']:.2f} s, sinkflex {b['step_s']:.2f} s ({speedup:.2f}x)",
                         "met": "yes" if speedup >= need * 0.999 else "no"})
        else:
            rows.append({"target": f"step time at {tokens:,} tokens: {what}", "measured": "not measured yet",
                         "met": ""})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------

def pd_numeric(series):
    import pandas as pd

    return pd.to_numeric(series, errors="coerce")

