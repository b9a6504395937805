#!/usr/bin/env bash
# GPU checks, run from the repository root on a CUDA machine (one GPU is enough):
#   1. tests/test_gpu.py: parity of the engine on the GPU (NCCL, megatron-core's distributed
#      optimizer and the AdamW path) against the single-process HF reference;
#   2. benchmarks/gpu_step.py: one DPO step configuration, ~1B Llama, bf16, reference interleaved.
# Results go to $OUT (default /tmp/gpu_checks).
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import torch, megatron.core, transformers; print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'transformers', transformers.__version__)" > "$OUT/versions.txt" 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py > "$OUT/test_gpu.txt" 2>&1
echo "test_gpu exit $?" >> "$OUT/test_gpu.txt"
timeout 240 python3 benchmarks/gpu_step.py --out "$OUT/gpu_step.json" > "$OUT/gpu_step.log" 2>&1
echo "gpu_step exit $?" >> "$OUT/gpu_step.log"
tail -5 "$OUT/test_gpu.txt" "$OUT/gpu_step.log"
