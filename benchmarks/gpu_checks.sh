#!/usr/bin/env bash
# The GPU-only checks, as one script. Run from the repository root on a machine with CUDA and the package
# importable (`pip install -e ".[test]"`, or PYTHONPATH=src with the dependencies present):
#
#   bash benchmarks/gpu_checks.sh                 # towers, profile, window: at most 7.5 minutes of steps
#   bash benchmarks/gpu_checks.sh tests demo      # the CUDA tests and the demo job (~6 minutes)
#   bash benchmarks/gpu_checks.sh all
#
# Every step has its own timeout and writes to ${OUT:-gpu_checks}/ as it goes (the benchmarks print each
# row when it is measured), so a step that runs out of time keeps what it measured and the next one starts.
# Sections: towers (base and SigLIP 2 base-sized towers in bf16 at sequence lengths 576, 1024, 256: window
# × full batch at n = 1, 2, 4, 8, peak memory, image tokens/s, MFU, each eager / checkpointed / compiled /
# both), window (the cache and replay windows vs the full batch, small and base), profile (torch.profiler
# of a window at n = 1 and 8: host syncs, launches), tests (tests/test_gpu.py), demo (`naflexclip train`
# on CUDA).
set -u -o pipefail
out=${OUT:-gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
sections=${*:-towers profile window}
[ "$sections" = all ] && sections="towers profile window tests demo"
has() { case " $sections " in *" $1 "*) return 0 ;; esac; return 1; }
step() {  # step SECONDS LOGFILE COMMAND...: one timed step, its output appended to LOGFILE and shown
    local limit=$1 log=$2; shift 2
    echo "== $* (limit ${limit}s)" | tee -a "$out/$log"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$log"
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$out/$log"
}

python3 - <<'EOF' 2>&1 | tee "$out/env.txt"
import torch, timm, open_clip
print("torch", torch.__version__, "timm", timm.__version__, "open_clip", open_clip.__version__,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF

if has towers; then
    # one process per tower size: compiled graphs (dynamic shapes) are reused across its sequence lengths
    for model in base siglip2-base; do
        step 160 towers.log python3 benchmarks/towers.py sweep --model "$model" --seq-lens 576 1024 256 \
            --tokens-per-batch 65536 --repeats 3 --out "$out/towers.md"
    done
fi
if has profile; then
    # the small preset is where an H200 was launch-bound (window 2.3-4.0x the full batch at n = 2-8)
    step 45 profile.log python3 benchmarks/towers.py profile --model small --seq-lens 144 \
        --tokens-per-batch 65536 --splits 8 --out "$out/profile.md"
    step 45 profile.log python3 benchmarks/towers.py profile --model base --seq-lens 576 \
        --tokens-per-batch 65536 --splits 8 --out "$out/profile.md"
fi
if has window; then
    step 60 window.log python3 benchmarks/window.py --model small --num-examples 512 --seq-lens 64 144 256 \
        --repeats 5 --precision amp_bf16
    step 80 window.log python3 benchmarks/window.py --model base --num-examples 128 --seq-lens 256 576 \
        --repeats 3 --precision amp_bf16
fi
if has tests; then
    step 200 tests.log python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
fi
if has demo; then
    step "${DEMO_TIMEOUT:-180}" demo.log bash -c "python3 -m naflexclip train --device cuda --workers 8 \
        --logs /tmp/gpu_demo --name demo ${DEMO_FLAGS:-} 2>&1 | tr '\r' '\n' | grep -v step/s"
    cp /tmp/gpu_demo/demo/metrics.jsonl "$out/demo_metrics.jsonl" 2>/dev/null || true
fi
