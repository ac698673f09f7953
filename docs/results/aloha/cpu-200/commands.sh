#!/usr/bin/env bash
# A harder setting for the encoder comparison: the cpu preset (with the object loss) on 200 demos and 2000 steps,
# both tasks, 5 encoders x 3 training seeds (30 policies), from the repository root of a 2-core machine: the two
# demo sets (~5 min each with two processes), then the policies two at a time (one core each, ~5-6 min per
# policy: 2000 training steps and 20 + 20 + 50 evaluation episodes), pooled by `merge`. About 1.5 h in all.
set -euo pipefail
W=${WORK:-runs/aloha-200}; mkdir -p "$W"
export MUJOCO_GL=egl OMP_NUM_THREADS=1
for T in insertion transfer_cube; do
    ropekit robot aloha collect --task $T --episodes 200 --frame-stride 4 --fovy 50 --depth --workers 2
done
R="ropekit robot aloha experiment --preset cpu --demos 200 --steps 2000 --threads 1 --no-progress"
runs=$(for T in transfer_cube insertion; do for S in 0 1 2; do for P in cayley axial mixed absolute cayley-rgbd; do
    echo "$T $S $P"; done; done; done)
echo "$runs" | xargs -P 2 -L 1 bash -c "$R"' --tasks $0 --seeds $1 --pe $2 --out '"$W"'/$0-$2-s$1 > '"$W"'/$0-$2-s$1.log 2>&1'
ropekit robot aloha merge $(echo "$runs" | while read T S P; do echo "$W/$T-$P-s$S"; done) --out docs/results/aloha/cpu-200
# The committed folder was made in two sittings: the five transfer-cube policies of seed 0 first, with the same
# command and --out "$W/$P-s0" (no task in the name), then the other 25, which joined that merge:
#   ropekit robot aloha merge docs/results/aloha/cpu-200 "$W"/transfer_cube-*-s[12] "$W"/insertion-*-s* \
#       --out docs/results/aloha/cpu-200
