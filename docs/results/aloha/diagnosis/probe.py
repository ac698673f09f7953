"""Does the encoder know where the cube is? Ridge probe from the policy's conditioning at the first frame to the
cube's xy: fit on the training demos' first frames, test on held-out poses (rendered like the demos)."""
import sys, numpy as np, torch
from ropekit.robot.aloha.policy import load_aloha_policy
from ropekit.robot.aloha.sim import AlohaSim
from ropekit.robot.aloha.expert import load_demo_set
from ropekit.robot.policy import images_from_obs
run, demos_path = sys.argv[1], sys.argv[2]
pol = load_aloha_policy(run); cfg = pol.config
d = load_demo_set(demos_path)
rows = d["frame_row"]; ep = d["episode"][rows]; st = d["step"][rows]
first = np.array([np.flatnonzero((ep == e) & (st == 0))[0] for e in range(len(d["episode_seed"]))])
sim = AlohaSim("transfer_cube", cameras=("top",), image_hw=cfg.image_hw, fovy=cfg.fovy)
def cube(seed): return sim.sample_object_pose(int(seed))[:2]
def cond(rgb, qpos):
    with torch.no_grad():
        return pol.encode(images_from_obs(rgb), torch.from_numpy(qpos)).numpy()
Xtr = cond(d["rgb"][first], d["qpos"][rows[first]].astype(np.float32)); Ytr = np.stack([cube(s) for s in d["episode_seed"]])
hel = range(100000, 100050); ims, qs, Yte = [], [], []
for s in hel:
    o = sim.reset(seed=s); ims.append(o["images"]["top"]); qs.append(o["qpos"]); Yte.append(cube(s))
Xte = cond(np.stack(ims), np.stack(qs)); Yte = np.stack(Yte)
mu, sd = Xtr.mean(0), Xtr.std(0) + 1e-6
A = (Xtr - mu) / sd; B = (Xte - mu) / sd
for lam in (1.0, 10.0, 100.0):
    W = np.linalg.solve(A.T @ A + lam * np.eye(A.shape[1]), A.T @ (Ytr - Ytr.mean(0)))
    ptr = A @ W + Ytr.mean(0); pte = B @ W + Ytr.mean(0)
    etr = np.linalg.norm(ptr - Ytr, axis=1).mean() * 100; ete = np.linalg.norm(pte - Yte, axis=1).mean() * 100
    base = np.linalg.norm(Yte - Ytr.mean(0), axis=1).mean() * 100
    print(f"{run} ridge {lam}: cube xy error train {etr:.1f} cm, held-out {ete:.1f} cm (predicting the mean: {base:.1f} cm)")
