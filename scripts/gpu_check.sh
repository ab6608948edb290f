#!/usr/bin/env bash
# The GPU checks that the CPU test tiers cannot do, on ONE GPU, in under 8 minutes. Nothing here has been run
# yet (no GPU was available when it was written); the results go to docs/performance.md ("GPU runs").
#
#   scripts/gpu_check.sh [OUT_DIR]                        # the checks below (7.5 min at most)
#   scripts/gpu_check.sh --maxlen SECONDS [OUT_DIR]       # the checks, then stage 3 within SECONDS
#   scripts/gpu_check.sh --only-maxlen SECONDS [OUT_DIR]  # the environment and stage 3 only
#
# OUT_DIR defaults to bench_results/gpu-<UTC time> (git-ignored).
# 1. python -m usp.bench.kernels: every CUDA backend (flash_attn if installed, sdpa_flash, sdpa_efficient,
#    sdpa_cudnn) forward and backward against a float64 reference, dense causal GQA and document-masked
#    (the per-segment SDPA path and flash_attn's varlen kernel), bf16 and fp32; plus TFLOP/s of the ring-step
#    kernel vs a pinned fused SDPA kernel. -> kernels.json; then head_dim 12 (only mem-efficient takes it).
# 2. usp-bench under torchrun on the nccl backend (1 process): the collectives that broke under nccl, and
#    the fwd/fwd+bwd step at 8K and 32K tokens, dense and with packed documents. -> usp_bench*.json
# Each step has its own timeout (3.5 + 1 + 1.5 + 1.5 min, 7.5 at most); a failing step is recorded and the next one still runs.
# 3. (only when asked: it does not fit a 15-minute session together with 1 and 2) python -m usp.bench.maxlen:
#    the longest sequence that trains Llama-3.1-8B (random weights; fewer layers when the host cannot hold its
#    offloaded states) on this GPU with checkpoint offload, MLP tiles and the optimizer on the host, one
#    trainer run per length, against the planner. -> maxlen.json,
#    maxlen-attempts/ (logs); its checkpoint (16 GB) and corpora stay in bench_results/maxlen-work for reruns.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
maxlen_s=""
checks=1
while [ $# -gt 0 ]; do
    case $1 in
        --maxlen | --only-maxlen)
            [ "$1" = --only-maxlen ] && checks=0
            maxlen_s=${2:-}
            case $maxlen_s in
                "" | *[!0-9]*) echo "$1 needs a whole number of seconds (e.g. $1 420)" >&2; exit 2 ;;
            esac
            shift 2 ;;
        -h | --help) sed -n '2,9p' "$0"; exit 0 ;;
        *) break ;;
    esac
done
out=${1:-bench_results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
py=${PYTHON:-python}
mkdir -p "$out"
status=0

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >>"$out/nvidia-smi.txt"
"$py" - >"$out/env.json" <<'PY'
import json, torch
try:
    import flash_attn
    fa = flash_attn.__version__
except Exception as exc:  # not installed, or a wheel for another ABI
    fa = f"unavailable: {type(exc).__name__}: {exc}"
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "flash_attn": fa}, indent=2))
PY

run() {  # run NAME SECONDS CMD...: log to $out/NAME.log, record the exit code
    local name=$1 seconds=$2
    shift 2
    echo "== $name: $*" | tee "$out/$name.log"
    timeout "$seconds" "$@" 2>&1 | tee -a "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "$name $rc" >>"$out/exit_codes.txt"
    [ "$rc" -eq 0 ] || status=1
}

if [ "$checks" -eq 1 ]; then
    run kernels 210 "$py" -m usp.bench.kernels --seq 4096 --heads 32 --kv-heads 8 --head-dim 128 --iters 5 \
        --out "$out/kernels.json"
    run kernels_head_dim_12 60 "$py" -m usp.bench.kernels --seq 1024 --heads 8 --kv-heads 2 --head-dim 12 --iters 2 \
        --out "$out/kernels_head_dim_12.json"  # what auto picks for such heads: sdpa_efficient, bf16 and fp32
    run usp_bench 90 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 -m usp.bench.attention \
        --ulysses 1 --ring 1 --layouts zigzag --seq 8192,32768 --heads 32 --kv-heads 8 --head-dim 128 \
        --dtype bfloat16 --iters 5 --out "$out/usp_bench.json"
    run usp_bench_docs 90 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 -m usp.bench.attention \
        --ulysses 1 --ring 1 --layouts zigzag --seq 32768 --heads 32 --kv-heads 8 --head-dim 128 \
        --dtype bfloat16 --doc-len 1000 --iters 5 --out "$out/usp_bench_docs.json"
fi
if [ -n "$maxlen_s" ]; then  # the search stops itself at its budget; the timeout is a backstop
    run maxlen "$((maxlen_s + 90))" "$py" -m usp.bench.maxlen --budget "$maxlen_s" --out "$out/maxlen.json" \
        --num-layers auto --steps 1 --work-dir bench_results/maxlen-work  # auto: all 32 where the host holds them
fi

echo "results in $out (exit codes: $(tr '\n' ' ' <"$out/exit_codes.txt"))"
exit "$status"
