#!/usr/bin/env bash
# Launch training with torchrun on this machine.
#   NGPU=4 CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 10
# Environment knobs:
#   NGPU         processes to start (default 1; works without a GPU: CPU processes talk over gloo)
#   CONFIG_FILE  TOML job file (default configs/debug_model.toml)
#   LOG_RANK     comma-separated ranks whose output is shown (default: all)
# Everything else on the command line is forwarded to train.py as config overrides.
set -euo pipefail
cd "$(dirname "$0")"

NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-./configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-}
PYTHON=${PYTHON:-python}

if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPU=$NGPU: expected a positive number of processes (e.g. NGPU=4)" >&2
    exit 2
fi
if [ ! -f "$CONFIG_FILE" ]; then
    echo "error: CONFIG_FILE=$CONFIG_FILE: file not found" >&2
    exit 2
fi

# Check the config before any process is started: a bad key fails here with one line.
WORLD_SIZE="$NGPU" "$PYTHON" train.py --job.config_file "$CONFIG_FILE" "$@" --print-config > /dev/null

filter=()
if [ -n "$LOG_RANK" ]; then
    filter=(--local-ranks-filter "$LOG_RANK")
fi
exec "$PYTHON" -m trainer.launch --standalone --nproc_per_node="$NGPU" "${filter[@]}" --role rank --tee 3 \
    train.py --job.config_file "$CONFIG_FILE" "$@"
