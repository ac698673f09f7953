"""ALOHA diagnosis driver: train one policy (JSON AlohaPolicyConfig and PolicyTrainConfig fields) on a cached demo
set into a run folder; with a last argument N > 0, also evaluate it on N held-out transfer-cube poses."""
import sys, json, time, torch, numpy as np
from ropekit.robot.aloha.policy import AlohaPolicy, AlohaPolicyConfig, AlohaChunks, evaluate_policy
from ropekit.robot.train import PolicyTrainConfig, train_policy
demos_path, out = sys.argv[1], sys.argv[2]
pol_kw = json.loads(sys.argv[3]); tr_kw = json.loads(sys.argv[4]); n_eval = int(sys.argv[5]) if len(sys.argv) > 5 else 50
torch.set_num_threads(tr_kw.get("num_threads", 1))
demos = dict(np.load(demos_path))
cfg = AlohaPolicyConfig(**pol_kw)
policy = AlohaPolicy(cfg)
data = AlohaChunks(demos, cfg)
t = time.time()
rows = train_policy(policy, data, PolicyTrainConfig(**tr_kw), out_dir=out, progress=False)
print("train s", time.time() - t, "loss", rows[-1]["loss"], flush=True)
if n_eval:
    r = evaluate_policy(policy, "transfer_cube", range(100000, 100000 + n_eval), parallel=10)
    print("success", r["success_rate"], "mean max reward", np.mean(r["max_reward"]), "s", r["seconds"], flush=True)
    json.dump(r, open(f"{out}/eval.json", "w"))
