"""Evaluate ALOHA policies (run folders with checkpoint.pt) and the expert on the same seeds; print success and reach gap."""
import sys, json, numpy as np
from ropekit.robot.aloha.policy import evaluate_policy, load_aloha_policy
from ropekit_studies.aloha import expert_ceiling
n = int(sys.argv[1]); seeds = range(100000, 100000 + n)
out = {}
for r in sys.argv[2:]:
    if r == "expert":
        ev = expert_ceiling("transfer_cube", list(seeds))
    else:
        ev = evaluate_policy(load_aloha_policy(r), "transfer_cube", seeds, parallel=10)
    g = np.array(ev["reach_gap"]) * 100
    print(f"{r}: success {ev['success_rate']:.2f} reach gap cm median {np.median(g):.1f} "
          f"q25 {np.percentile(g,25):.1f} q75 {np.percentile(g,75):.1f} ({ev['seconds']:.0f} s)", flush=True)
    out[r] = ev
json.dump(out, open(f"gap_{n}.json", "w"))
