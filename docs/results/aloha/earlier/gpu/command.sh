# The GPU run, exactly as executed (one call of the device tool, 7-minute limit, one NVIDIA H100 80GB HBM3,
# 16 CPU cores, Python 3.12, torch 2.11): the gpu preset on transfer-cube with 1500 training steps, split
# into four processes (2 seeds x 2 groups of encoders) that share one cached demo set, then pooled with
# `ropekit robot aloha merge`. MuJoCo renders through the GPU's EGL; the machine lacked the GL loader
# libraries (libglvnd, libEGL, ...: .gl/*.deb) and the simulator packages (unpacked wheels in .whl/site:
# gym-aloha 0.1.5, mujoco 3.8.1, dm_control 1.0.41 without its locomotion assets, dm-env, dm-tree, glfw,
# PyOpenGL, gymnasium, Farama-Notifications).
for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
V=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json; [ -f $V ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$V
cd .wt/aloha && export PYTHONPATH=$PWD:$(cd ../../.whl/site && pwd) MUJOCO_GL=egl OMP_NUM_THREADS=2
C=/tmp/aloha-cache
python3 -m ropekit.cli robot aloha collect --task transfer_cube --episodes 50 --image-size 96x128 --depth \
    --frame-stride 2 --cache-dir $C
R="python3 -m ropekit.cli robot aloha experiment --preset gpu --tasks transfer_cube --steps 1500 --device cuda
   --cache-dir $C --demo-depth --no-checkpoints --no-progress"
($R --seeds 0 --pe absolute,axial,mixed --out $OUT/s0a > $OUT/s0a.log 2>&1 &
 $R --seeds 0 --pe cayley,cayley-rgbd --out $OUT/s0b > $OUT/s0b.log 2>&1 &
 $R --seeds 1 --pe absolute,axial,mixed --out $OUT/s1a > $OUT/s1a.log 2>&1 &
 $R --seeds 1 --pe cayley,cayley-rgbd --out $OUT/s1b > $OUT/s1b.log 2>&1 & wait)
python3 -m ropekit.cli robot aloha merge $OUT/s0a $OUT/s0b $OUT/s1a $OUT/s1b --out $OUT/merged
