#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on one CUDA GPU, under 9 minutes: PPO-max with a ~85M-parameter
# Llama under DeepSpeed ZeRO-2, ZeRO-3, FSDP, with LoRA, with the vLLM rollout engine (that variant
# needs the CUDA `vllm` package; `--variants vllm` runs it alone) and with asynchronous rollouts
# (`--variants zero2 async` compares the two); step time, rollout vs bare-generate tokens/s, peak GPU
# memory vs the memory plan, MFU. Needs a CUDA build of torch==2.13.0 in the environment (the CPU
# wheel of `make install` cannot run it): PYTHON=/path/to/python bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_BUILD_OPS=0
timeout 560 "$PYTHON" bench/gpu_check.py "$@"
