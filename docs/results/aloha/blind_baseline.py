# The image-blind baseline: replay the mean of the first CPU study's 20 demo joint trajectories on the 50
# evaluation seeds (no camera). Run from the repository root once those demos are cached
# (`ropekit robot aloha collect --episodes 20 --frame-stride 4 --depth`, the first line of diagnosis/commands.sh):
#   PYTHONPATH=$PWD python docs/results/aloha/blind_baseline.py
import glob, numpy as np, time
from ropekit.robot.aloha.expert import default_cache_dir, load_demo_set
from ropekit.robot.aloha.sim import AlohaSim
d = load_demo_set(str(default_cache_dir() / 'transfer_cube-e74ec830eda3c042.npz'))
A = d['action'].reshape(-1, 400, 14)
mean = A.mean(0)
sim = AlohaSim('transfer_cube', cameras=())
ok = []; rewards = []; gaps = []
t = time.time()
for s in range(100000, 100050):
    sim.reset(seed=s, render=False); best = 0; gap = sim.reach_gap()
    for a in mean:
        _, r = sim.step(a.astype(np.float64), render=False); best = max(best, r); gap = min(gap, sim.reach_gap())
        if r >= 4: break
    ok.append(best >= 4); rewards.append(best); gaps.append(gap)
print(f"image-blind mean demo trajectory: success {np.mean(ok):.2f} over 50 eval seeds, mean max reward {np.mean(rewards):.2f}, "
      f"closest approach of the right gripper to the cube median {np.median(gaps) * 100:.1f} cm, {time.time()-t:.0f} s")
