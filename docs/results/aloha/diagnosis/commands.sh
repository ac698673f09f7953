#!/usr/bin/env bash
# The ALOHA diagnosis runs of ../README.md ("Where the information is lost"), from the repository root.
# Each training run takes 12-20 min on one core of the 2-core build machine; output.txt holds what they printed.
set -euo pipefail
D=$(cd "$(dirname "$0")" && pwd)
W=${WORK:-runs/aloha-diagnosis}; mkdir -p "$W" && cd "$W"
CACHE=${ROPEKIT_ALOHA_CACHE:-$HOME/.cache/ropekit/aloha}
ropekit robot aloha collect --episodes 20 --frame-stride 4 --depth            # the CPU preset's 20 demos
ropekit robot aloha collect --episodes 200 --frame-stride 4 --fovy 50         # 200 demos, 50-degree camera
D20=$CACHE/transfer_cube-e74ec830eda3c042.npz; D200=$CACHE/transfer_cube-3b0572e79264a635.npz
ENC='"pe":"cayley","vit_overrides":{"depth":3,"patch_size":8,"embed_dim":96,"num_heads":3},"cond_dim":192,"hidden_dim":256,"num_blocks":3,"num_inference_steps":8,"prediction":"sample","keypoints":true'
TR='{"steps":4000,"batch_size":64,"lr":1e-3,"warmup_steps":100,"noise_samples":2,"ema_decay":0.995,"log_every":50,"num_threads":1'
python "$D/train.py" "$D20" runs/x0_4k "{$ENC}" "$TR,\"shift\":2}" 0
python "$D/train.py" "$D200" runs/x0_200_fov50 "{$ENC,\"fovy\":50}" "$TR,\"shift\":0}" 0
python "$D/train.py" "$D200" runs/h64_200_fov50 "{$ENC,\"fovy\":50,\"horizon\":64,\"n_action_steps\":32}" "$TR,\"shift\":0}" 0
python "$D/train.py" "$D200" runs/rel_200_fov50 "{$ENC,\"fovy\":50,\"action_mode\":\"relative\"}" "$TR,\"shift\":0}" 0
# success and closest approach on the 50 held-out poses (and the expert's), then on training poses
python "$D/evalgap.py" 50 expert runs/x0_4k runs/x0_200_fov50 runs/h64_200_fov50 runs/rel_200_fov50
python "$D/evaltrain.py" runs/x0_200_fov50 50
python "$D/evaltrain.py" runs/x0_4k 20
# does the conditioning know where the cube is (ridge probe), does the first chunk follow it
python "$D/probe.py" runs/x0_4k "$D20"
python "$D/probe.py" runs/x0_200_fov50 "$D200"
python "$D/probe.py" runs/h64_200_fov50 "$D200"
for r in runs/x0_200_fov50 runs/h64_200_fov50 runs/rel_200_fov50; do python "$D/chunk0.py" "$r"; done
# the image-blind reference: the mean demo trajectory replayed open loop
(cd "$OLDPWD" && python docs/results/aloha/blind_baseline.py)
# images only: the CPU study's Cayley-STRING policy (2000 demos, preset cpu) with the joint state hidden from
# its conditioning, seeds 0 and 1 (~29 min each on one core); noproprio/ holds their results and output
ropekit robot aloha collect --episodes 2000 --frame-stride 4 --fovy 50 --depth --workers 2
for s in 0 1; do python "$D/noproprio.py" runs/noproprio/cayley-s$s $s; done
# told the cube: the same policy with the cube's initial position appended to its joint state (privileged,
# from the simulator), seeds 0 and 1; oracle/ holds their results and output
for s in 0 1; do python "$D/oracle.py" runs/oracle/cayley-s$s $s; done
# the cube loss: the same policy with an auxiliary loss (its conditioning predicts the cube's initial position,
# privileged, training only): Cayley-STRING seeds 0-3, learned APE seeds 0-1; cubeaux/ holds their results and output
for s in 0 1 2 3; do python "$D/cubeaux.py" runs/cubeaux/cayley-s$s $s; done
for s in 0 1; do python "$D/cubeaux.py" runs/cubeaux/ape-s$s $s "ViT (learned APE)"; done
# the cube loss on the image alone: its head reads the image features only (no joint state) and predicts where the
# cube is in each frame (the demos replayed once, physics only): Cayley-STRING seed 0, the seed that failed with
# the loss above; seecube/ holds its result and output
python "$D/seecube.py" runs/seecube/cayley-s0 0
