"""The ``sinkflex`` command: what the Makefile does, reachable without make.

    sinkflex notebooks list            the tutorials, in order, with their parameters
    sinkflex reproduce [--only 03]     run the notebooks headless (papermill)
    sinkflex test [--no-notebooks]     ruff + pytest + nbval (smoke mode)
    sinkflex docs [--out build/docs]   the stored lessons as HTML pages (nbconvert), with an index
    sinkflex env                       versions, device, FlexAttention and vLLM status
    sinkflex train ...                 the GRPO trainer (see `sinkflex train --help`)
    sinkflex bench vram ...            the VRAM comparison harness
    sinkflex bench results [--readme F] the paper's claims beside ours (Markdown)
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path


def _parse_param(text: str) -> tuple[str, object]:
    import ast

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"parameter must look like name=value, got {text!r}")
    name, value = text.split("=", 1)
    name = name.strip()
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"parameter name {name!r} is not a Python name")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        pass
    # the spellings a shell user types for Python's True, False and None; anything else is a string
    words = {"true": True, "false": False, "none": None}
    return name, words.get(value.strip().lower(), value)


def _cmd_notebooks(args) -> int:
    from .notebooks import list_notebooks, select, store_outputs

    if args.action == "list":
        for nb in list_notebooks():
            params = ", ".join(f"{k}={v!r}" for k, v in nb.parameters.items())
            print(f"{nb.name}\n    {nb.title}\n    parameters: {params or '(none)'}")
        return 0
    # store: refresh the stored (smoke-mode) outputs that nbval compares against
    try:
        chosen = select(args.names)
    except ValueError as err:
        print(f"sinkflex notebooks store: {err}", file=sys.stderr)
        return 2
    for nb in chosen:
        print(f"storing smoke-mode outputs of {nb.name}", flush=True)
        store_outputs(nb.path)
    return 0


def _cmd_reproduce(args) -> int:
    from .notebooks import reproduce

    return reproduce(only=args.only, parameters=dict(args.param or []), smoke=args.smoke, force=args.force)


def _cmd_test(args) -> int:
    from .paths import repo_root

    root = repo_root()
    env = dict(os.environ, SINKFLEX_SMOKE="1", MPLBACKEND="Agg", JUPYTER_PLATFORM_DIRS="1")
    print("== ruff check", flush=True)
    rc = subprocess.call([sys.executable, "-m", "ruff", "check", "."], cwd=root, env=env)
    if rc:
        return rc
    cmd = [sys.executable, "-m", "pytest", "tests"]
    if not args.no_notebooks:
        cmd += ["notebooks", "--nbval-lax", "--nbval-current-env",
                "--nbval-sanitize-with", "tests/nbval_sanitize.cfg"]
    cmd += ["-m", "not vllm and not gpu", *args.pytest_args]
    print("== " + " ".join(cmd[2:]), flush=True)
    before = _changed_files(root)
    rc = subprocess.call(cmd, cwd=root, env=env)
    if rc == 5:
        print("pytest collected no test: counted as a failure", file=sys.stderr)
        return 1
    rewritten = sorted(path for path, digest in _changed_files(root).items() if before.get(path) != digest)
    if rewritten:
        print("the tests wrote or rewrote files of the project (they must write under build/ or a temporary "
              "folder only): " + ", ".join(rewritten),
              file=sys.stderr)
        return rc or 1
    return rc


def _changed_files(root) -> dict[str, str]:
    """Files that differ from the last commit, the tracked ones and the new ones git does not ignore,
    with a digest of their content (empty outside a git checkout), so a test run can tell what it
    changed or created itself from what was there before."""
    import hashlib

    try:
        names = set()
        for cmd in (["git", "diff", "--name-only", "HEAD"], ["git", "ls-files", "--others", "--exclude-standard"]):
            names.update(subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                                        check=True).stdout.splitlines())
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {name: hashlib.sha256((root / name).read_bytes()).hexdigest() if (root / name).is_file() else "deleted"
            for name in names if name}


def _cmd_docs(args) -> int:
    from .notebooks import render_html

    try:
        pages = render_html(args.out, args.only)
    except ValueError as err:
        print(f"sinkflex docs: {err}", file=sys.stderr)
        return 2
    solutions = sum(page.parent.name == "solutions" for page in pages[1:])
    print(f"{len(pages) - 1 - solutions} lessons rendered, with {solutions} solutions pages; open {pages[0]}")
    return 0


def _cmd_env(args) -> int:
    from .system import print_report

    print_report()
    return 0


_DELEGATED = {"train": "sinkflex_core.train", "bench": "sinkflex_core.bench"}


def _main_of(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sinkflex", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    nb = sub.add_parser("notebooks", help="list the tutorials, or refresh their stored outputs")
    nb.add_argument("action", choices=["list", "store"])
    nb.add_argument("names", nargs="*", help="notebooks for `store`, by number or name prefix (default: all)")
    nb.set_defaults(func=_cmd_notebooks)

    rp = sub.add_parser("reproduce", help="run every notebook headless with papermill")
    rp.add_argument("--only", nargs="+", help="notebooks by number or name prefix, e.g. 00 03 (or 0 3)")
    rp.add_argument("-p", "--param", action="append", type=_parse_param, metavar="NAME=VALUE",
                    help="notebook parameter as a Python literal (true/false/none also read), passed to "
                         "every notebook that declares it; refused when none declares it or its kind differs")
    rp.add_argument("--smoke", action="store_true", help="run in smoke mode (seconds per notebook)")
    rp.add_argument("--force", action="store_true", help="re-run notebooks even if nothing changed")
    rp.set_defaults(func=_cmd_reproduce)

    ts = sub.add_parser("test", help="ruff + pytest + nbval (what `make test` runs)")
    ts.add_argument("--no-notebooks", action="store_true", help="skip the nbval notebook checks")
    ts.add_argument("pytest_args", nargs=argparse.REMAINDER,
                    help="extra pytest arguments and options, after --no-notebooks (e.g. -k resume -x)")
    ts.set_defaults(func=_cmd_test)

    dc = sub.add_parser("docs", help="render the stored lessons to HTML (build/docs/index.html)")
    dc.add_argument("--out", type=Path, default=None, help="output folder (default: build/docs)")
    dc.add_argument("--only", nargs="+", help="notebooks by number or name prefix, e.g. 01 05")
    dc.set_defaults(func=_cmd_docs)

    ev = sub.add_parser("env", help="versions, device, FlexAttention and vLLM status")
    ev.set_defaults(func=_cmd_env)

    # listed for --help only: main() hands `train` and `bench` to their own modules before parsing
    sub.add_parser("train", help="the GRPO trainer (`sinkflex train --help`)", add_help=False)
    sub.add_parser("bench", help="benchmarks: `sinkflex bench vram --help`; `sinkflex bench results`: paper vs ours",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    argv = sys.argv[1:] if argv is None else list(argv)
    # `train` and `bench` own their options: hand everything after the command word to them as is
    # (argparse's REMAINDER would reject a leading option such as `sinkflex train --lr 1e-4`).
    if argv and argv[0] in _DELEGATED:
        return _main_of(_DELEGATED[argv[0]], argv[1:])
    if argv and argv[0] == "test":
        # the same for pytest's options after `test`'s own (`sinkflex test --no-notebooks -k resume -x`),
        # which REMAINDER refuses too when one comes first; a `--` before them is accepted and dropped
        own = 1
        while own < len(argv) and argv[own] in ("--no-notebooks", "-h", "--help"):
            own += 1
        args = build_parser().parse_args(argv[:own])
        args.pytest_args = argv[own + (argv[own:own + 1] == ["--"]):]
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("sinkflex_core."):
            print(f"sinkflex: `{args.command}` is not available in this version ({err.name} missing)",
                  file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
