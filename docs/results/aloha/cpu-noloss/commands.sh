#!/usr/bin/env bash
# The CPU study WITHOUT the object loss (transfer-cube, preset cpu as it was before the loss: --aux-weight 0;
# 2000 demos, 6000 steps per policy, 5 encoders x 2 seeds), from the
# repository root of a 2-core machine: the demo set once (two processes), then the ten policies in two
# processes of five (one core each; the splits are pooled by `merge`). About 35-45 min per policy.
set -euo pipefail
W=${WORK:-runs/aloha-cpu}; mkdir -p "$W"
export MUJOCO_GL=egl OMP_NUM_THREADS=1
ropekit robot aloha collect --episodes 2000 --frame-stride 4 --fovy 50 --depth --workers 2
R="ropekit robot aloha experiment --preset cpu --aux-weight 0 --threads 1 --no-progress"
# (the recorded commands in config.json have no --aux-weight: when they ran, the preset had no object loss)
( $R --seeds 0 --pe cayley,axial,mixed --out "$W/a0" > "$W-a.log" 2>&1
  $R --seeds 1 --pe cayley,axial --out "$W/a1" >> "$W-a.log" 2>&1 ) &
( $R --seeds 0 --pe absolute,cayley-rgbd --out "$W/b0" > "$W-b.log" 2>&1
  $R --seeds 1 --pe absolute,mixed,cayley-rgbd --out "$W/b1" >> "$W-b.log" 2>&1 ) &
wait
ropekit robot aloha merge "$W/a0" "$W/b0" "$W/a1" "$W/b1" --out docs/results/aloha/cpu-noloss
# The committed folder was made in two sittings: the above gave eight policies (axial and Cayley RGB-D of seed 1
# were interrupted with the machine); on a fresh machine the demo set was collected again (the same cache key)
# and the two ran on their own, then joined the committed merge:
#   R --seeds 1 --pe axial --out "$W/c1" & R --seeds 1 --pe cayley-rgbd --out "$W/d1" & wait
#   ropekit robot aloha merge docs/results/aloha/cpu-noloss "$W/c1" "$W/d1" --out docs/results/aloha/cpu-noloss
