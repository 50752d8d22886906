"""Constructors of the executing environments (``sinkflex/Bash-v0``, ``sinkflex/CodeRepair-v0``).

Both run agent commands in the jail of :mod:`.sandbox` and refuse to start where it does not work,
unless ``allow_unjailed=True``. Both give a :class:`~.judge.JudgedToolEnv`: the verifier's reward
mixed with a judge (by default the rule-based :class:`~.judge.FormatJudge` at weight 0.1; ``judge=None``
for the verifier alone, or any callable such as :class:`~.judge.HFJudge`)::

    env = gymnasium.make("sinkflex/Bash-v0", split="test")
    env = gymnasium.make("sinkflex/CodeRepair-v0", judge=None)
"""

from __future__ import annotations

from .base import env_around
from .judge import DEFAULT_JUDGE_WEIGHT, JudgedToolEnv
from .sandbox import Limits


def make_bash_env(split: str = "train", max_turns: int = 12, render_mode: str | None = None,
                  judge="format", judge_weight: float = DEFAULT_JUDGE_WEIGHT, limits: Limits | None = None,
                  allow_unjailed: bool = False) -> JudgedToolEnv:
    """``sinkflex/Bash-v0``: NL2Bash-style requests over a seeded folder, commands run jailed."""
    from .bash_env import BashBackend

    backend = BashBackend(limits, allow_unjailed=allow_unjailed)
    return env_around(backend, JudgedToolEnv, split=split, max_turns=max_turns, render_mode=render_mode,
                      judge=judge, judge_weight=judge_weight)


def make_code_repair_env(split: str = "train", max_turns: int = 16, render_mode: str | None = None,
                         judge="format", judge_weight: float = DEFAULT_JUDGE_WEIGHT, limits: Limits | None = None,
                         allow_unjailed: bool = False) -> JudgedToolEnv:
    """``sinkflex/CodeRepair-v0``: fix a planted bug; the share of hidden cases passing is the verifier."""
    from .code_repair import CodeRepairBackend

    backend = CodeRepairBackend(limits, allow_unjailed=allow_unjailed)
    return env_around(backend, JudgedToolEnv, split=split, max_turns=max_turns, render_mode=render_mode,
                      judge=judge, judge_weight=judge_weight)
