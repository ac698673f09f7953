#!/usr/bin/env bash
# More seeds for the depth-6 classification (docs/results/classify-depth6), the arms the
# STRING-vs-RoPE and rotary-vs-APE decisions rest on, paired by seed.
#
# Each (seed, encoding) is one run of the study's own command; its row is appended to
# runs.csv here as soon as it finishes, so a killed loop loses at most the run in progress.
# Resumable: rows already in runs.csv are skipped. Run from the repository root:
#
#   OMP_NUM_THREADS=1 COMMIT=1 nohup bash docs/results/classify-depth6-seeds/run.sh 5 12 \
#       > runs/classify-depth6-seeds.log 2>&1 &
#
#   ARMS="mixed cayley circulant axial" OMP_NUM_THREADS=1 COMMIT=1 nohup bash docs/results/classify-depth6-seeds/run.sh 13 49 \
#       > runs/classify-depth6-seeds.log 2>&1 &      # seeds 13 onward (see ARMS below)
#
# COMMIT=1 commits runs.csv and docs/results/claims.md after every run (nothing else).
#
# The first seeds (0-4) are the committed study itself; this folder only holds seeds 5 onward.
set -euo pipefail
first=${1:-5}
last=${2:-49}
here=docs/results/classify-depth6-seeds
csv=$here/runs.csv
# ARMS: the encodings to run (default all five). From seed 13 on the APE arm is left out (ARMS="mixed cayley
# circulant axial"): every rotary - APE claim holds at 13 seeds, and the seeds go to the STRING - RoPE pairs.
arms=${ARMS:-"mixed cayley circulant axial absolute"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for seed in $(seq "$first" "$last"); do
  for pe in $arms; do
    if [ -f "$csv" ] && grep -q "^$pe,$seed," "$csv"; then continue; fi
    out=runs/classify-depth6-seeds/$pe-s$seed
    rm -rf "$out"
    python -c 'import sys; from ropekit.cli import main; sys.argv[0] = "ropekit"; sys.exit(main())' \
      experiment classify --model-opt depth=6 --pe "$pe" --seeds "$seed" --threads 1 --no-progress \
      --out "$out"
    python - "$out/classify.csv" "$csv" <<'PY'
import csv, sys
src, dst = sys.argv[1], sys.argv[2]
cols = ["pe", "seed", "test_acc", "test_loss", "train_acc", "train_loss", "num_params", "wall_time", "device", "run"]
with open(src, newline="") as f:
    rows = list(csv.DictReader(f))
import os
new = not os.path.exists(dst)
with open(dst, "a", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
    if new:
        w.writeheader()
    for r in rows:
        w.writerow(r)
PY
    python -m ropekit_studies.claims docs/results > /dev/null  # the claims page follows runs.csv
    if [ "${COMMIT:-0}" = 1 ]; then  # each finished run committed at once (only these two files)
      git commit -q -m "classify-depth6-seeds: $pe seed $seed" -- "$csv" docs/results/claims.md || true
    fi
    echo "$(date -u +%FT%TZ) done $pe s$seed"
  done
done
