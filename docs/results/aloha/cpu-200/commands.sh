#!/usr/bin/env bash
# A harder setting for the encoder comparison: the cpu preset (with the object loss) on 200 demos and 2000 steps,
# one training seed, from the repository root of a 2-core machine: the demo set (~5 min with two processes), then
# the five policies in two processes (one core each, ~6 min per policy), pooled by `merge`.
set -euo pipefail
W=${WORK:-runs/aloha-200}; mkdir -p "$W"
export MUJOCO_GL=egl OMP_NUM_THREADS=1
ropekit robot aloha collect --episodes 200 --frame-stride 4 --fovy 50 --depth --workers 2
R="ropekit robot aloha experiment --preset cpu --demos 200 --steps 2000 --threads 1 --no-progress"
( for p in cayley axial mixed; do $R --seeds 0 --pe $p --out "$W/$p-s0" >> "$W/a.log" 2>&1; done ) &
( for p in absolute cayley-rgbd; do $R --seeds 0 --pe $p --out "$W/$p-s0" >> "$W/b.log" 2>&1; done ) &
wait
ropekit robot aloha merge "$W"/cayley-s0 "$W"/axial-s0 "$W"/mixed-s0 "$W"/absolute-s0 "$W"/cayley-rgbd-s0 \
    --out docs/results/aloha/cpu-200
