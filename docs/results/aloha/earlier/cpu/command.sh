# the CPU default study (transfer-cube), run on the shared 2-core build machine
cd "$(git rev-parse --show-toplevel)"
MUJOCO_GL=egl LP_NUM_THREADS=0 OMP_NUM_THREADS=1 PYTHONPATH=$PWD \
    python -m ropekit.cli robot aloha experiment --preset cpu --out docs/results/aloha/cpu --no-progress
