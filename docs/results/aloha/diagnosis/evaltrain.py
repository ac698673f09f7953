"""Evaluate an ALOHA policy on the object poses of its own training demos (seeds 0..n-1)."""
import sys, json, numpy as np
from ropekit.robot.aloha.policy import evaluate_policy, load_aloha_policy
run, n = sys.argv[1], int(sys.argv[2])
ev = evaluate_policy(load_aloha_policy(run), "transfer_cube", range(n), parallel=10)
g = np.array(ev["reach_gap"]) * 100
print(f"{run} on training poses: success {ev['success_rate']:.2f} reach gap cm median {np.median(g):.1f} "
      f"q25 {np.percentile(g,25):.1f} q75 {np.percentile(g,75):.1f} ({ev['seconds']:.0f} s)", flush=True)
json.dump(ev, open(f"{run}/eval_train_{n}.json", "w"))
