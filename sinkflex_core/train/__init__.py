"""GRPO training of a tool-using policy, on one CPU or on N GPUs with FSDP2.

    sinkflex train                                   # preset tiny-cpu, a 1.6M-parameter policy
    sinkflex train --lr 1e-4 --group-size 4 --set eval_every=5
    sinkflex train --preset paper-8xh100 --print-config
    torchrun --nproc_per_node 8 -m sinkflex_core.train --preset paper-8xh100 --out-dir runs/paper

The modules, in the order a step uses them:

- ``config``: :class:`TrainConfig` (each field with its help text), the presets, command lines;
- ``data``: which tasks a step trains on, and the rollout batch as (B, L) tensors;
- ``policy``: building the model, and :class:`TokenLogprobs`, its per-token log-probs;
- ``update``: one GRPO update (the function the memory harness times too);
- ``trainer``: :class:`Trainer`, the loop (collect -> advantages -> update -> metrics), and ``main``;
- ``distributed``, ``checkpoint``, ``metrics``: process group and FSDP2, crash-safe checkpoints, the log;
- ``evaluate``: pass@k, success tables, the task screen, reward-curve tables.
"""

from ..plots import (
    PAPER_REWARD_END,
    PAPER_REWARD_START,
    async_figure,
    async_timeline_figure,
    plot_reward_curves,
    plot_test_gains,
    plot_timeline,
    plot_training_reward,
    reward_figure,
)
from .checkpoint import (
    file_digest,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from .config import (
    COMPACT_SYSTEM_PROMPT,
    PAPER_8XH100,
    PRESETS,
    SEED_LIMIT,
    TINY_CPU,
    ConfigError,
    TrainConfig,
    add_config_arguments,
    build_arg_parser,
    cli_value,
    config_from_argv,
    is_optional,
    option,
    parse_field,
    parse_value,
    resolve_config,
    rollout_config,
    torchrun_command,
)
from .data import TaskSampler, concat_rollouts, count_tasks, derive_seed, position_in_group, trim_rows
from .distributed import Dist, init_distributed, shard_model
from .evaluate import (
    CURVE_COLUMNS,
    async_summary,
    bootstrap_mean,
    curve_table,
    evaluations,
    gain_difference,
    paired_gains,
    per_task_rewards,
    policy_digest,
    reward_version,
    screen_or_reuse,
    screened_tasks,
    success_counts,
    success_table,
    summarize_curves,
    task_kinds,
)
from .layer_sinks import expert_calibration_ids, resolve_layer_sinks
from .metrics import METRIC_COLUMNS, METRIC_HELP, TIMING_COLUMNS, MetricsLog, step_timeline
from .policy import TokenLogprobs, causal_lm, load_model, load_tokenizer, trainable_parameters
from .trainer import Trainer, main
from .update import frozen_logprobs, grpo_update, loss_config, lr_lambda, micro_batches

__all__ = [
    "CURVE_COLUMNS", "COMPACT_SYSTEM_PROMPT", "METRIC_COLUMNS", "METRIC_HELP", "PAPER_8XH100", "SEED_LIMIT", "PAPER_REWARD_END",
    "PAPER_REWARD_START", "PRESETS", "TIMING_COLUMNS", "TINY_CPU", "ConfigError", "Dist", "MetricsLog",
    "TaskSampler", "TokenLogprobs", "TrainConfig", "Trainer", "add_config_arguments", "build_arg_parser",
    "causal_lm", "cli_value", "concat_rollouts", "config_from_argv", "count_tasks", "curve_table", "derive_seed",
    "async_figure", "async_summary", "async_timeline_figure", "bootstrap_mean", "evaluations", "gain_difference", "paired_gains", "expert_calibration_ids", "file_digest",
    "frozen_logprobs", "grpo_update", "init_distributed", "is_optional",
    "latest_checkpoint", "list_checkpoints", "load_checkpoint", "load_model", "load_tokenizer", "loss_config",
    "lr_lambda", "main", "micro_batches", "option", "parse_field", "parse_value", "per_task_rewards",
    "plot_reward_curves", "plot_test_gains", "plot_timeline", "plot_training_reward", "policy_digest", "position_in_group",
    "resolve_config", "reward_figure",
    "resolve_layer_sinks", "reward_version", "rng_state",
    "rollout_config", "save_checkpoint", "screen_or_reuse", "screened_tasks", "set_rng_state", "shard_model",
    "step_timeline", "success_counts", "success_table", "summarize_curves", "task_kinds", "torchrun_command",
    "trainable_parameters", "trim_rows", "verify_checkpoint",
]
