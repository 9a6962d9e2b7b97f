#!/usr/bin/env bash
# Exercise every GPU path of fleethealth on a machine with a CUDA device, in a few minutes.
# Each part prints one JSON object; this script prints them under a heading and a short table.
#   bash bench/gpu_check.sh            # all parts
#   bash bench/gpu_check.sh kernels    # one part: kernels | nvml | injob | timer
# Needs: pip install -e '.[gpu,nvml,injob]' (CuPy, nvidia-ml-py, torch with CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
parts=("${@:-kernels nvml injob timer}")
rc=0
for part in ${parts[*]}; do
  echo "== $part"
  case "$part" in
    kernels) python bench/gpu_kernels.py || rc=1 ;;
    nvml)    python bench/gpu_nvml.py || rc=1 ;;
    injob)   python bench/gpu_injob.py || rc=1 ;;
    timer)   python bench/gpu_timer.py || rc=1 ;;
    *) echo "unknown part '$part' (known: kernels nvml injob timer)" >&2; exit 2 ;;
  esac
done
exit $rc
