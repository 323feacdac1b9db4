#!/usr/bin/env bash
# The one device run for an H200 session (see benchmarks/README.md): profile
# llama3-8b on the GPU, then validate the simulator against the engine at 50% and
# 85% load with that profile. Work goes to $WORK; $OUT receives at most 8 files
# (the device tool's limit): the profile, the logs and one tarball of everything.
# Tested end to end on CPU with: DEVICE=cpu MODEL=tiny bash benchmarks/h200_run.sh
set -u
OUT=${OUT:-results/h200}
WORK=${WORK:-/tmp/h200work}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-llama3-8b}
BUDGET=${BUDGET:-240}
N=${N:-150}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${SKIP_WHL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null | tee "$WORK/gpu.txt"
timeout $((BUDGET + 120)) python3 benchmarks/gpu_profile.py --model "$MODEL" --device "$DEVICE" \
  --out "$WORK" --budget-s "$BUDGET" ${QUICK:+--quick} 2>&1 | tee "$WORK/profile.log"
PROFILE=$(ls "$WORK"/*.json 2>/dev/null | head -1)
if [ -z "$PROFILE" ]; then echo "no profile written"; exit 1; fi
echo "profile: $PROFILE"
for LOAD in 0.5 0.85; do
  timeout 200 python3 -m simulator.cli validate --profile "$PROFILE" --device "$DEVICE" \
    --model "$MODEL" --limit "$N" --load "$LOAD" --max-prompt-tokens 1024 \
    --max-output-tokens 128 --max-num-seqs 32 --max-num-batched-tokens 512 \
    --out "$WORK/val-$LOAD" 2>&1 | tee "$WORK/validate-$LOAD.log"
done
ls -la "$WORK" "$WORK"/val-* 2>/dev/null
tar czf "$OUT/h200-all.tgz" -C "$WORK" .
cp "$PROFILE" "$WORK"/*.log "$OUT"/ 2>/dev/null
ls -la "$OUT"
