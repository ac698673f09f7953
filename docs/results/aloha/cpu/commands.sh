#!/usr/bin/env bash
# The CPU study (transfer-cube, preset cpu: 2000 demos, 6000 steps per policy with the object loss, 5 encoders x
# 2 seeds), from the repository root of a 2-core machine: the demo set once (two processes, ~50 min), then the
# ten policies one per call in two processes of five (one core each), pooled by `merge`. ~20 min per policy.
set -euo pipefail
W=${WORK:-runs/aloha-cpu}; mkdir -p "$W"
export MUJOCO_GL=egl OMP_NUM_THREADS=1
ropekit robot aloha collect --episodes 2000 --frame-stride 4 --fovy 50 --depth --workers 2
R="ropekit robot aloha experiment --preset cpu --threads 1 --no-progress"
( for x in "0 cayley" "1 cayley" "0 axial" "1 axial" "0 mixed"; do set -- $x
    $R --seeds $1 --pe $2 --out "$W/$2-s$1" >> "$W/a.log" 2>&1; done ) &
( for x in "0 absolute" "1 absolute" "0 cayley-rgbd" "1 cayley-rgbd" "1 mixed"; do set -- $x
    $R --seeds $1 --pe $2 --out "$W/$2-s$1" >> "$W/b.log" 2>&1; done ) &
wait
ropekit robot aloha merge "$W"/cayley-s0 "$W"/cayley-s1 "$W"/axial-s0 "$W"/axial-s1 "$W"/mixed-s0 \
    "$W"/absolute-s0 "$W"/absolute-s1 "$W"/cayley-rgbd-s0 "$W"/cayley-rgbd-s1 "$W"/mixed-s1 --out docs/results/aloha/cpu
# how well each policy's object head finds the cube in the first frames of the 50 held-out poses
python docs/results/aloha/diagnosis/locate.py docs/results/aloha/cpu/locate.json "$W"/*/runs/transfer_cube/*/
