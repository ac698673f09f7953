# The GPU run (one call of at most 7 minutes on one NVIDIA GPU): the gpu preset on transfer-cube with
# 1500 training steps, split into four processes (2 seeds x 2 groups of encoders) sharing one cached
# demo set, then pooled with `ropekit robot aloha merge`. MuJoCo renders through the GPU's EGL.
export PYTHONPATH=$PWD:$SITE MUJOCO_GL=egl OMP_NUM_THREADS=2   # SITE: gym-aloha, mujoco, dm_control, ...
C=/tmp/aloha-cache
python -m ropekit.cli robot aloha collect --task transfer_cube --episodes 50 --image-size 96x128 --depth \
    --frame-stride 2 --cache-dir $C
R="python -m ropekit.cli robot aloha experiment --preset gpu --tasks transfer_cube --steps 1500 --device cuda
   --cache-dir $C --demo-depth --no-checkpoints --no-progress"
$R --seeds 0 --pe absolute,axial,mixed --out $OUT/s0a > $OUT/s0a.log 2>&1 &
$R --seeds 0 --pe cayley,cayley-rgbd --out $OUT/s0b > $OUT/s0b.log 2>&1 &
$R --seeds 1 --pe absolute,axial,mixed --out $OUT/s1a > $OUT/s1a.log 2>&1 &
$R --seeds 1 --pe cayley,cayley-rgbd --out $OUT/s1b > $OUT/s1b.log 2>&1 &
wait
python -m ropekit.cli robot aloha merge $OUT/s0a $OUT/s0b $OUT/s1a $OUT/s1b --out $OUT/merged
