#!/usr/bin/env bash
# Retrain runs of the committed MNIST studies on another machine and measure how far they move, from the
# repository root. The run ids are configuration hashes, so a run of the same configuration trained elsewhere is
# matched by tools/compare_runs.py. Measured 2026-11-26 on a 2-core AMD EPYC (PyTorch CPU kernels on AVX2): the
# two training commands side by side, one core each, about 2 h (the depth-6 / 40-epoch runs take 6-11 minutes).
set -euo pipefail
D=docs/results/across-machines
# seeds 0 and 1 of every arm of the scale study (committed in docs/results/scale)
ropekit experiment scale --seeds 0,1 --out $D/scale-s01 --no-progress
# seeds 3 and 4 of the arms that are the classification at depth 2 and at depth 6 (docs/results/classify and
# docs/results/classify-depth6; the scale recipe has seeds 0-2, these two seeds are outside it)
ropekit experiment scale --seeds 3,4 --arms 2x10,6x10 --out $D/scale-s34 --no-progress
for metric in test_acc train_acc; do
  python tools/compare_runs.py $D/scale-s01 docs/results/scale --metric $metric --json $D/s01-$metric.json \
    --plot $D/s01-$metric.png > $D/s01-$metric.md
  python tools/compare_runs.py $D/scale-s34 docs/results/classify docs/results/classify-depth6 --metric $metric \
    --json $D/s34-$metric.json --plot $D/s34-$metric.png > $D/s34-$metric.md
done
