"""sinkflex: GRPO for long-horizon, tool-using LLM agents with sink-aware FlexAttention.

Importing the package registers the Gymnasium environments (``sinkflex/Retail-v0`` and the other
worlds listed in :mod:`sinkflex_core.envs`); everything heavier (torch models, attention, rollouts,
training) is imported from its own module on demand.
"""

from __future__ import annotations

__version__ = "0.1.0"

try:
    from . import envs  # noqa: E402,F401  (registers the environments)
except ModuleNotFoundError as _err:
    # A machine that only measures memory or speed (the GPU harness) may lack gymnasium; everything
    # but the environments still works there.
    if _err.name != "gymnasium":
        raise
