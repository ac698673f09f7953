"""Does the first predicted chunk follow the cube? Per right-arm joint: correlation across 50 held-out poses between
the policy's chunk (from the first frame) and the expert's joint targets at the chunk's last step."""
import sys, numpy as np, torch
from ropekit.robot.aloha.policy import load_aloha_policy
from ropekit.robot.aloha.sim import AlohaSim
from ropekit.robot.aloha.expert import expert_episode
from ropekit.robot.policy import images_from_obs
pol = load_aloha_policy(sys.argv[1]); cfg = pol.config; H = cfg.horizon
sim = AlohaSim("transfer_cube", cameras=("top",), image_hw=cfg.image_hw, fovy=cfg.fovy)
rep, ee = AlohaSim("transfer_cube", cameras=()), AlohaSim("transfer_cube", mode="ee", cameras=())
ims, qs, ex = [], [], []
for s in range(100000, 100050):
    o = sim.reset(seed=s); ims.append(o["images"]["top"]); qs.append(o["qpos"])
    ex.append(expert_episode("transfer_cube", s, replay=rep, ee_sim=ee)["action"])
ex = np.stack(ex)
g = torch.Generator().manual_seed(0)
pred = pol.predict(images_from_obs(np.stack(ims)), torch.from_numpy(np.stack(qs)), g).numpy()
for k in sorted({H // 4 - 1, H // 2 - 1, H - 1}):
    cs = [np.corrcoef(pred[:, k, j], ex[:, k, j])[0, 1] for j in range(7, 13)]
    sd_ex = ex[:, k, 7:13].std(0).mean(); rms = np.sqrt(((pred[:, k, 7:13] - ex[:, k, 7:13]) ** 2).mean())
    print(f"{sys.argv[1]} step {k}: corr per right-arm joint {np.round(cs, 2)}; expert spread {sd_ex:.3f} rad, policy rms error {rms:.3f} rad")
