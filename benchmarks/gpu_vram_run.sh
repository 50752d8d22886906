#!/usr/bin/env bash
# The VRAM comparison on one GPU (sized for an H200, ~8 minutes): one GRPO step of a
# Qwen2.5-7B-shaped model (random bf16 weights, LoRA r=16 on q,k,v,o, gradient checkpointing,
# batch 1), capped at 80 GiB to stand in for an 80 GB card. Each case runs in its own process.
#
#   OUT=/some/folder bash benchmarks/gpu_vram_run.sh           # measure
#   SMOKE=1 OUT=/some/folder bash benchmarks/gpu_vram_run.sh   # every group once, tiny model, 1,024 tokens
#   LIST=1 bash benchmarks/gpu_vram_run.sh                     # print the planned cases (no GPU needed)
#
# Writes $OUT/vram_<gpu>.csv (copy it to data/) and $OUT/vram_run.log. Installs nothing: it needs
# torch (CUDA), transformers and peft already installed; gymnasium is not needed (the harness loads
# only the modules of the step). Groups run in order of importance. No case runs past BUDGET_S seconds
# from the start: a case's timeout is cut to what is left, cases with less than 20 s left are recorded
# as "skipped", and once the budget is spent the remaining groups are listed in the log, not started.
# A case that runs out of memory or times out is not run at longer lengths. To fit this run and
# benchmarks/gpu_attention_check.py (3-5 minutes) into about 15 minutes of GPU time with the machine's
# start-up, set BUDGET_S to about 300 and give the check a --budget.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-build/vram}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
SMOKE="${SMOKE:-0}"
BUDGET_S="${BUDGET_S:-$([[ "$SMOKE" == 1 ]] && echo 150 || echo 450)}"   # seconds of measuring, start-up included
CHUNK="${CHUNK:-512}"         # log-prob chunk: one chunk's float32 logits are CHUNK x 152,064 x 4 B

# Each group: "<per-case timeout s>|<harness arguments>", most important first.
GROUPS_LIST=(
    # 1. Target: sinkflex + memory-light log-probs at 8k (<= 18.5 GiB), step time against stock sdpa.
    "150|--attention sinkflex sdpa --logprobs chunked --mlp plain --tokens 8192 --warmup 1"
    # 2. Targets: 131,072 tokens under 80 GiB, and >= 2x faster than sdpa at 64k and 128k (tiled MLP;
    #    sinkflex warms up once to pay its compile, sdpa has nothing to compile).
    "240|--attention sinkflex --logprobs chunked --mlp tiled --tokens 65536 131072 --warmup 1"
    "200|--attention sdpa --logprobs chunked --mlp tiled --tokens 65536 131072 --warmup 0"
    # 3. The paper's points: the standard step (stock sdpa, full-vocabulary logits) at 4k and 8k,
    #    SINKFLEX at 4k, and stock eager, where "standard OOM" should come first (16k under the cap).
    "120|--attention sdpa --logprobs full --mlp plain --tokens 4096 8192 --warmup 1"
    "150|--attention sinkflex --logprobs chunked --mlp plain --tokens 4096 --warmup 1"
    "120|--attention eager --logprobs full --mlp plain --tokens 8192 16384 --warmup 0"
    # 4. If time is left: sinkflex with full logits, the 32k point, transformers' stock flex_attention.
    "150|--attention sinkflex --logprobs full --mlp plain --tokens 4096 8192 --warmup 1"
    "150|--attention sinkflex sdpa --logprobs chunked --mlp tiled --tokens 32768 --warmup 1"
    "150|--attention flex --logprobs full chunked --mlp plain --tokens 8192 --warmup 1"
)

# Run from the checkout without installing it (the GPU machine has torch, transformers and peft; the
# package imports without gymnasium there).
BOOT="import sys; sys.path.insert(0, '$PWD'); from sinkflex_core.bench import main; sys.exit(main(sys.argv[1:]))"

if [[ "${LIST:-0}" == 1 ]]; then
    for g in "${GROUPS_LIST[@]}"; do
        # shellcheck disable=SC2086
        "$PY" -c "$BOOT" vram --preset qwen25-7b --device cpu ${g#*|} --list || exit 1
    done
    exit 0
fi

# A copied tree may lack .git: name the commit from outside with SINKFLEX_GIT_SHA=...
export SINKFLEX_GIT_SHA="${SINKFLEX_GIT_SHA:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
mkdir -p "$OUT"
LOG="$OUT/vram_run.log"
START=$(date +%s)
if ! "$PY" -c "import torch, transformers, peft, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    echo "gpu_vram_run: needs a CUDA GPU and torch, transformers, peft importable by $PY" | tee -a "$LOG"
    exit 2
fi
"$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '|', torch.cuda.get_device_name(0))" | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee -a "$LOG"
SLUG=$("$PY" -c "import re, torch; n = torch.cuda.get_device_name(0).lower().replace('nvidia', ''); print(re.sub(r'[^a-z0-9]+', '-', n).strip('-'))")
CSV="$OUT/vram_${SLUG}$([[ "$SMOKE" == 1 ]] && echo _smoke).csv"
rm -f "$CSV"

PRESET=qwen25-7b
if [[ "$SMOKE" == 1 ]]; then
    PRESET=tiny   # the same code paths (LoRA, checkpointing, compiled sink attention) in seconds a case
    echo "== smoke run: preset tiny, 1,024 tokens, every group's cases once" | tee -a "$LOG"
fi
for g in "${GROUPS_LIST[@]}"; do
    timeout="${g%%|*}"
    cases="${g#*|}"
    if [[ "$SMOKE" == 1 ]]; then
        timeout=60
        cases=$(sed -E 's/--tokens( [0-9]+)+/--tokens 1024/' <<< "$cases")
    fi
    left=$(( BUDGET_S - ($(date +%s) - START) ))
    if (( left < 20 )); then
        echo "== [$(( $(date +%s) - START )) s] not started, the time budget is spent: $cases" | tee -a "$LOG"
        continue
    fi
    echo "== [$(( $(date +%s) - START )) s] $cases" | tee -a "$LOG"
    # shellcheck disable=SC2086
    "$PY" -c "$BOOT" vram --preset "$PRESET" --device cuda --cap-gib 80 --chunk-size "$CHUNK" --out "$CSV" \
        --append --timeout "$timeout" --budget "$left" $cases 2>&1 | tee -a "$LOG"
done
echo "== done in $(( $(date +%s) - START )) s -> $CSV" | tee -a "$LOG"
