#!/usr/bin/env bash
# Launch training with torchrun, on this machine or on several nodes.
#   NGPU=4 CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 10
#   NNODES=2 NGPU=8 RDZV_ENDPOINT=node0:29500 ./run_train.sh ...    # the same command on every node
# Environment knobs:
#   NGPU           processes to start on this node (default 1; works without a GPU: CPU processes talk over gloo)
#   CONFIG_FILE    TOML job file (default: this folder's configs/debug_model.toml)
#   LOG_RANK       comma-separated local ranks whose output is shown (default: all)
#   NNODES         nodes in the job (default 1: a standalone job on this machine)
#   RDZV_ENDPOINT  host:port every node can reach, for torchrun's c10d rendezvous (default
#                  MASTER_ADDR:MASTER_PORT; required when NNODES > 1)
#   RDZV_ID        job id shared by the nodes of one job (default SLURM_JOB_ID, else "trainer")
# Everything else on the command line is forwarded to train.py as config overrides.
# Relative paths (CONFIG_FILE, dump_folder, dataset_path, ...) are taken from the folder you run this
# from, as for any command; the script itself may live elsewhere.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

NGPU=${NGPU:-1}
NNODES=${NNODES:-1}
CONFIG_FILE=${CONFIG_FILE:-$here/configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-}
PYTHON=${PYTHON:-python}

if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPU=$NGPU: expected a positive number of processes (e.g. NGPU=4)" >&2
    exit 2
fi
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NNODES=$NNODES: expected a positive number of nodes (e.g. NNODES=2)" >&2
    exit 2
fi
if [ ! -f "$CONFIG_FILE" ]; then
    message="error: CONFIG_FILE=$CONFIG_FILE: file not found"
    if [[ "$CONFIG_FILE" != /* ]]; then
        message="$message (looked for $PWD/$CONFIG_FILE)"
        if [ -f "$here/$CONFIG_FILE" ]; then
            message="$message; the trainer's folder has one: CONFIG_FILE=$here/$CONFIG_FILE"
        fi
    fi
    echo "$message" >&2
    exit 2
fi

if [ "$NNODES" = 1 ]; then
    rendezvous=(--standalone)
else
    endpoint=${RDZV_ENDPOINT:-}
    if [ -z "$endpoint" ] && [ -n "${MASTER_ADDR:-}" ]; then
        endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
    fi
    if ! [[ "$endpoint" =~ ^[^:[:space:]]+:[0-9]+$ ]]; then
        echo "error: NNODES=$NNODES needs RDZV_ENDPOINT=host:port (or MASTER_ADDR and MASTER_PORT) that every node" \
             "can reach; got '${endpoint}'" >&2
        exit 2
    fi
    host=${endpoint%:*}
    port=${endpoint##*:}
    if [ "${#port}" -gt 5 ] || [ "$((10#$port))" -lt 1 ] || [ "$((10#$port))" -gt 65535 ]; then
        echo "error: RDZV_ENDPOINT=$endpoint: port $port is not a port number (1-65535)" >&2
        exit 2
    fi
    # A host name that does not resolve would fail inside torchrun after its timeouts (minutes).
    if ! "$PYTHON" -c 'import socket, sys; socket.getaddrinfo(sys.argv[1], None)' "$host" 2>/dev/null; then
        echo "error: RDZV_ENDPOINT=$endpoint: host '$host' cannot be resolved from this node" >&2
        exit 2
    fi
    rendezvous=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$endpoint"
                --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-trainer}}")
fi

filter=()
if [ -n "$LOG_RANK" ]; then
    if ! [[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
        echo "error: LOG_RANK=$LOG_RANK: expected comma-separated local ranks (e.g. LOG_RANK=0 or LOG_RANK=0,1)" >&2
        exit 2
    fi
    for r in ${LOG_RANK//,/ }; do
        if [ "${#r}" -gt 6 ] || [ "$((10#$r))" -ge "$NGPU" ]; then
            echo "error: LOG_RANK=$LOG_RANK: local rank $r does not exist with NGPU=$NGPU (local ranks 0-$((NGPU - 1)));" \
                 "its output would be shown and every other rank's hidden" >&2
            exit 2
        fi
    done
    filter=(--local-ranks-filter "$LOG_RANK")
fi
# --check-config: the launcher checks the config and job plan for NNODES x NGPU ranks before it
# starts any process (a bad key fails here with one line), sharing its torch import with torchrun.
# ${filter[@]+...}: an empty array expands to nothing under set -u on every bash (3.2 included)
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"  # the trainer package, also when not installed
# What torchrun does itself with several processes and no OMP_NUM_THREADS, without its banner on every launch.
if [ "$NGPU" -gt 1 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
    export OMP_NUM_THREADS=1
fi
exec "$PYTHON" -m trainer.launch --check-config "${rendezvous[@]}" --nproc-per-node="$NGPU" \
    ${filter[@]+"${filter[@]}"} --role rank --tee 3 "$here/train.py" --job.config_file "$CONFIG_FILE" "$@"
