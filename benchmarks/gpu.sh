#!/usr/bin/env bash
# paraloom on a CUDA machine, in one command (about 3-6 minutes): a 1.2B-parameter GPT (24
# layers, hidden 2048, 16 heads, sequence 2048, the bundled byte corpus) trained in bf16 with
# fp32 main grads, sdpa attention and gradient-accumulation fusion on every local GPU (dp over
# the GPUs with the distributed optimizer unless TP/PP say otherwise); then its tokens/s and MFU
# (model FLOPs from paraloom.analysis.flops over the GPU's dense bf16 peak) and `paraloom check`
# on the two recorded steps (CUDA-event times). Exit 0 only if the run, its held-out loss and the
# check are all sound.
#
#   bash benchmarks/gpu.sh                                  # the defaults below
#   LAYERS=24 HIDDEN=1024 HEADS=16 bash benchmarks/gpu.sh   # a 300M model
#   TP=2 SP=1 bash benchmarks/gpu.sh                        # tp 2 with sequence parallelism
#
# Settings it applies (README, "On CUDA"): CUDA_DEVICE_MAX_CONNECTIONS=1 when tp > 1, so the
# tensor-parallel collectives start in the order the layers launch them and overlap the GEMMs
# they are meant to overlap (Megatron needs the same); NCCL's own defaults otherwise.
# DEVICE=cpu runs the same pipeline on local gloo ranks with a small model (the test suite does,
# so the script itself is tested on machines without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ -z "${PYTHON:-}" ]; then  # the first of the venv's and the system's python that sees CUDA
  for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c \
        "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
      PYTHON=$candidate
      break
    fi
  done
  if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
  fi
fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "gpu.sh: $PYTHON cannot import torch (set PYTHON=... to a python with PyTorch)" >&2
  exit 1
fi
DEVICE=${DEVICE:-cuda}
OUT=${OUT_DIR:-runs/gpu}
TP=${TP:-1} PP=${PP:-1} SP=${SP:-0}
if [ "$DEVICE" = cuda ]; then
  read -r NGPU NAME < <("$PYTHON" -c "import torch; n = torch.cuda.device_count(); \
print(n, torch.cuda.get_device_name(0) if n else 'none')")
  if [ "$NGPU" -lt 1 ]; then
    echo "gpu.sh: no CUDA device visible to $PYTHON (torch.cuda.device_count() = 0)" >&2
    exit 1
  fi
  LAYERS=${LAYERS:-24} HIDDEN=${HIDDEN:-2048} HEADS=${HEADS:-16} SEQ=${SEQ:-2048}
  MBS=${MBS:-4} MICROBATCHES=${MICROBATCHES:-4} STEPS=${STEPS:-20} WARMUP=${WARMUP:-5}
  EXTRA=(--dtype bf16 --attention sdpa --gradient-accumulation-fusion)
  PEAK=()
else  # the pipeline on CPU: 2 gloo ranks, a small fp32 model, MFU against a nominal peak
  NGPU=${NPROC:-2} NAME="cpu (gloo)"
  LAYERS=${LAYERS:-2} HIDDEN=${HIDDEN:-64} HEADS=${HEADS:-4} SEQ=${SEQ:-64}
  MBS=${MBS:-2} MICROBATCHES=${MICROBATCHES:-2} STEPS=${STEPS:-8} WARMUP=${WARMUP:-2}
  EXTRA=(--attention sdpa)
  PEAK=(--peak-tflops "${PEAK_TFLOPS:-0.1}")
fi
if [ $((NGPU % (TP * PP))) -ne 0 ]; then
  echo "gpu.sh: $NGPU devices do not divide into TP=$TP x PP=$PP" >&2
  exit 2
fi
DP=$((NGPU / (TP * PP)))
GBS=$((MBS * MICROBATCHES * DP))
LAYOUT=(--tp "$TP" --pp "$PP" --dp "$DP")
[ "$DP" -gt 1 ] && LAYOUT+=(--distributed-optimizer)
[ "$SP" = 1 ] && LAYOUT+=(--sequence-parallel)
[ "$TP" -gt 1 ] && export CUDA_DEVICE_MAX_CONNECTIONS=1

echo "gpu.sh: $NGPU x $NAME; tp=$TP pp=$PP dp=$DP; $LAYERS layers, hidden $HIDDEN, seq $SEQ," \
     "micro batch $MBS, global batch $GBS, $STEPS steps; python $PYTHON"
rm -rf "$OUT"
TRAIN=(train --out "$OUT" --layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS"
       --seq-len "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS" --steps "$STEPS"
       --warmup-steps 2 --lr 3e-4 --min-lr 3e-5 --ledger-steps 2 --save-every 0
       "${LAYOUT[@]}" "${EXTRA[@]}")
if [ "$DEVICE" = cuda ]; then
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m paraloom "${TRAIN[@]}"
else
  "$PYTHON" -m paraloom "${TRAIN[@]}" --nprocs "$NGPU"
fi
"$PYTHON" benchmarks/gpu_summary.py "$OUT" --gpus "$NGPU" --device-name "$NAME" \
  --warmup "$WARMUP" "${PEAK[@]}"
"$PYTHON" -m paraloom check "$OUT"
echo "gpu.sh: all sound"
