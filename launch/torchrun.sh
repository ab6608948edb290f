#!/usr/bin/env bash
# Start usp.train on this machine: one torchrun, one process per GPU (or N CPU processes on gloo).
#
#   launch/torchrun.sh [--nproc-per-node N] [--cpu] [--max-restarts R] [--entry train|eval] [--] [hydra overrides...]
#
#   launch/torchrun.sh recipe=llama2_7b_rope_32k ...                 # one process per visible GPU
#   launch/torchrun.sh --nproc-per-node 4 recipe=llama2_7b_rope_32k  # 4 GPUs (pick them with CUDA_VISIBLE_DEVICES)
#   launch/torchrun.sh --cpu --nproc-per-node 4 recipe=tiny         # 4 CPU processes on gloo
#
# It runs:  torchrun --standalone --nproc-per-node N [--max-restarts R] -m usp.train [trainer.device=cpu parallel.backend=gloo] OVERRIDES
#
# --max-restarts R: after a rank fails, torchrun restarts all of them (up to R times); they resume from the
# run dir's last checkpoint. SIGTERM to torchrun reaches every rank: they checkpoint, stop and exit 75.
#
# torchrun exports LOCAL_WORLD_SIZE=N to every rank; the mesh takes it as the node size, so Ulysses groups
# (adjacent ranks) stay on this node. `usp-launch torchrun ... --dry-run` prints the same command and checks
# the parallel.* degrees against N first. Multi-node runs: launch/slurm.sbatch.
set -euo pipefail

die() {
  echo "torchrun.sh: $*" >&2
  exit 2
}

nproc=""
cpu=0
restarts=""
module="usp.train"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node | --gpus-per-node)
      [[ $# -ge 2 ]] || die "$1 needs a value, e.g. $1 4"
      nproc="$2"
      shift 2
      ;;
    --nproc-per-node=* | --gpus-per-node=*)
      nproc="${1#*=}"
      shift
      ;;
    --cpu)
      cpu=1
      shift
      ;;
    --max-restarts)
      [[ $# -ge 2 ]] || die "$1 needs a value, e.g. $1 1"
      restarts="$2"
      shift 2
      ;;
    --max-restarts=*)
      restarts="${1#*=}"
      shift
      ;;
    --entry)
      [[ $# -ge 2 ]] || die "--entry needs a value: train or eval"
      [[ "$2" == train || "$2" == eval ]] || die "--entry $2: use train (usp.train) or eval (usp.eval)"
      module="usp.$2"
      shift 2
      ;;
    -h | --help)
      sed -n '2,17s/^# \{0,1\}//p' "$0"
      exit 0
      ;;
    --)
      shift
      break
      ;;
    -*) die "unknown option $1 (options: --nproc-per-node N, --cpu, --max-restarts R, --entry train|eval; then Hydra overrides key=value)" ;;
    *) break ;;
  esac
done

# CUDA_VISIBLE_DEVICES (when set and non-empty) restricts the GPUs a process sees: count its entries, up to
# the first negative one as CUDA does, and never more than nvidia-smi lists.
visible_gpus() {
  local listed="$1" visible=0 cvd="${CUDA_VISIBLE_DEVICES:-}" id ids
  [[ -n "${cvd// /}" ]] || {
    echo "$listed"
    return
  }
  IFS=',' read -ra ids <<< "$cvd"
  for id in "${ids[@]}"; do
    id="${id// /}"
    [[ "$id" == -* ]] && break
    [[ -n "$id" ]] && visible=$((visible + 1))
  done
  echo $((visible < listed ? visible : listed))
}

if [[ -n "$restarts" ]] && ! [[ "$restarts" =~ ^[0-9]+$ ]]; then
  die "--max-restarts=$restarts is invalid: use an integer >= 0."
fi
if [[ -n "$nproc" ]] && ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
  die "--nproc-per-node=$nproc is invalid: use an integer >= 1."
fi
if [[ -z "$nproc" ]]; then
  if [[ "$cpu" == 1 ]]; then
    die "--cpu needs --nproc-per-node N (the number of CPU processes, e.g. 4)."
  fi
  gpus=0
  if command -v nvidia-smi > /dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
  fi
  gpus=$(visible_gpus "$gpus")
  if [[ "$gpus" -lt 1 ]]; then
    die "no GPUs found (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES:-}' hides them): pass --nproc-per-node N, or --cpu --nproc-per-node N for CPU processes on gloo."
  fi
  nproc="$gpus"
fi

# The user's overrides win: a launcher default is added only when its key is not on the command line.
has_key() {
  local key="$1" word
  shift
  for word in "$@"; do
    word="${word#"${word%%[!+~]*}"}"
    [[ "${word%%=*}" == "$key" ]] && return 0
  done
  return 1
}
defaults=()
if [[ "$cpu" == 1 ]]; then
  has_key trainer.device "$@" || defaults+=("trainer.device=cpu")
  has_key parallel.backend "$@" || defaults+=("parallel.backend=gloo")
fi

if ! command -v torchrun > /dev/null 2>&1; then
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  [[ -x "$repo/.venv/bin/torchrun" ]] || die "torchrun is not on PATH: activate the environment (source .venv/bin/activate) or run 'make install'."
  export PATH="$repo/.venv/bin:$PATH"
fi

restart_args=()
if [[ -n "$restarts" && "$restarts" != 0 ]]; then
  restart_args=(--max-restarts "$restarts")
fi
cmd=(torchrun --standalone --nproc-per-node "$nproc" ${restart_args[@]+"${restart_args[@]}"} -m "$module" ${defaults[@]+"${defaults[@]}"} "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
