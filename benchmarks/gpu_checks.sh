#!/usr/bin/env bash
# The GPU-only checks, as one script: the CUDA tests, the window benchmark on the GPU (small and base
# presets, bf16 autocast), and the demo job on CUDA. Run from the repository root on a machine with CUDA
# and the package importable (`pip install -e ".[test]"`, or PYTHONPATH=src with the dependencies present).
# Logs go to ${OUT:-gpu_checks}/.
set -u -o pipefail
out=${OUT:-gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 - <<'EOF' 2>&1 | tee "$out/env.txt"
import torch, timm, open_clip
print("torch", torch.__version__, "timm", timm.__version__, "open_clip", open_clip.__version__,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF

echo "== CUDA tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests.txt"

echo "== window benchmark"
timeout 200 python3 benchmarks/window.py --model small --num-examples 512 --seq-lens 64 144 256 \
    --repeats 10 --precision amp_bf16 2>&1 | tee "$out/window.md"
timeout 200 python3 benchmarks/window.py --model base --num-examples 128 --seq-lens 256 576 \
    --repeats 5 --precision amp_bf16 2>&1 | tee -a "$out/window.md"

echo "== demo job on CUDA"
timeout "${DEMO_TIMEOUT:-240}" python3 -m naflexclip train --device cuda --workers 8 --logs /tmp/gpu_demo \
    --name demo ${DEMO_FLAGS:-} 2>&1 | tr '\r' '\n' | grep -v "step/s" | tee "$out/demo.txt"
cp /tmp/gpu_demo/demo/metrics.jsonl "$out/demo_metrics.jsonl" 2>/dev/null || true
