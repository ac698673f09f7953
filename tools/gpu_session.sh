#!/usr/bin/env bash
# The GPU measurements of docs/performance.md, in stages that each fit a 10-minute command on a lent GPU.
#
#   bash tools/gpu_session.sh all             # FIRST on any loan (~9.5 min): the CUDA tests (with the packed
#                                             # varlen attention test, not yet run on a GPU), the ViT-B/16 bf16
#                                             # step eager and compiled against APE, the recompile counts per
#                                             # encoding, the eager steps' kernel tables -- 6 files in $OUT
#   bash tools/gpu_session.sh new             # first on a short loan: what this version has not measured on a GPU
#                                             # (the folded in-training rows, ComRoPE's rows; ~3 min)
#   bash tools/gpu_session.sh checks          # kernel, folding, precision and adversarial tests on CUDA (~4.5 min)
#   bash tools/gpu_session.sh peop            # every encoding's op table, alone and in training (~4 min)
#   bash tools/gpu_session.sh vit-eager       # ViT-B/16 training step against APE and timm, eager (~4 min)
#   bash tools/gpu_session.sh vit-compiled    # the same under torch.compile(mode="reduce-overhead") (~6 min)
#   bash tools/gpu_session.sh syncs           # host synchronisations per ViT-B step, eager and compiled (~3 min)
#   bash tools/gpu_session.sh folded          # the folded encodings at RoPE's cost, in one call (~8.5 min): the
#                                             # sync-free and CUDA-graph tests, the encodings alone in training
#                                             # against the floor, the ViT-B/16 bf16 step eager and under
#                                             # reduce-overhead (CUDA graphs) for ape, axial, mixed, cayley,
#                                             # circulant and comrope-ld
#   DRY=1 bash tools/gpu_session.sh folded    # print the stages' commands without running them (no GPU needed)
#
# Several stages can be named in one call; each is cut off by `timeout` so that a slow one cannot take the
# rest with it, leaving the Python traceback of where it was in the log. Results go to $OUT (default ./gpu-out):
# <gpu>-<stage>.json / .md from `ropekit bench`, and <gpu>-log.txt with every stage's output. <gpu> is h100,
# h200, ... from the device's name. Run from the repository root with the project importable (PYTHONPATH=$PWD or
# `pip install --no-deps -e .`).
set -u
[ $# -gt 0 ] || { sed -n '2,25p' "$0"; exit 2; }
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1  # a stage cut off by its limit (SIGABRT) leaves every thread's traceback in the log
export PYTHONPATH=${PYTHONPATH:-$PWD}
# a plain `python` that imports torch: where only a venv's python3 has it (a symlink to it would lose the venv),
# a wrapper script that execs it
if ! python -c "import torch" 2>/dev/null && command -v python3 >/dev/null; then
  mkdir -p /tmp/ropekit-bin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/ropekit-bin/python
  chmod +x /tmp/ropekit-bin/python && export PATH=/tmp/ropekit-bin:$PATH
fi
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
gpu=$(echo "$name" | grep -oiE 'h100|h200|a100|l40s|l4|a10' | head -n 1 | tr 'A-Z' 'a-z')
gpu=${gpu:-gpu}
log="$OUT/$gpu-log.txt"
bench="python -m ropekit.bench --device cuda --dtype bf16"
{
  echo "== $(date -u +%FT%TZ) device: ${name:-none}"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
} | tee -a "$log"

run_stage() {  # name, time limit in seconds, command...
  local stage=$1 limit=$2
  shift 2
  echo "== stage $stage (limit ${limit}s): $*" | tee -a "$log"
  if [ "${DRY:-0}" = 1 ]; then return 0; fi
  timeout -s ABRT -k 10 "$limit" "$@" >> "$log" 2>&1
  echo "== stage $stage: exit $?" | tee -a "$log"
}

for stage in "$@"; do
  case $stage in
    all)  # 530 s of limits, within 9.5 minutes; 6 files in $OUT: the log, the tests' JUnit XML, the ViT table eager
          # (.json, .md), compiled (.json, .md; ComRoPE-LD's compilation alone outran 100 s on an H200), the recompile
          # counts (.md); the kernel tables of the eager steps (where axial's 1.2x APE goes) are in the log
      run_stage all-tests 120 python -m pytest -q -rfs -p no:cacheprovider -o addopts="" \
        tests/test_sync_free_step.py tests/test_skew_schur.py tests/test_nn_batched_bases.py \
        tests/test_adversarial_devices.py tests/test_compile_step.py \
        tests/test_varlen.py::test_varlen_on_cuda_equals_each_image_alone -k "not compiles_once or on_cuda" \
        --junitxml "$OUT/$gpu-all-tests.xml"
      run_stage all-eager 80 $bench --quick --rows none --cases grid2d --vit base --vit-modes eager \
        --vit-pes axial mixed cayley circulant comrope-ld --no-timm \
        --json "$OUT/$gpu-all-eager.json" --markdown "$OUT/$gpu-all-eager.md"
      run_stage all-compiled 150 $bench --quick --rows none --cases grid2d --vit base --vit-modes compiled \
        --compile-mode reduce-overhead --vit-pes axial mixed cayley circulant --no-timm \
        --json "$OUT/$gpu-all-compiled.json" --markdown "$OUT/$gpu-all-compiled.md"
      run_stage all-recompiles 120 python tools/recompiles.py --device cuda --mode reduce-overhead --steps 20 \
        --pes cayley comrope-ld absolute axial --markdown "$OUT/$gpu-all-recompiles.md"
      run_stage all-profile 60 python tools/profile_step.py profile absolute axial mixed circulant
      ;;
    new)
      run_stage new-peop 300 $bench --no-vit --cases grid2d rgbd3d --rows cayley "comrope-ld (b=8)" \
        "cayley in training (folded)" "circulant in training (folded)" "comrope-ld (b=8) in training (folded)" \
        --json "$OUT/$gpu-new-peop.json" --markdown "$OUT/$gpu-new-peop.md"
      ;;
    checks)
      run_stage checks 420 python -m pytest -q -rfs -p no:cacheprovider tests/test_kernels_rotary.py tests/test_kernels_basis.py \
        tests/test_cuda_precision.py tests/test_nn_batched_bases.py tests/test_nn_fold_overhead.py \
        tests/test_adversarial_devices.py tests/test_adversarial_precision.py tests/test_adversarial_paths.py \
        tests/test_varlen.py::test_varlen_on_cuda_equals_each_image_alone
      ;;
    peop)
      run_stage peop 420 $bench --no-vit --json "$OUT/$gpu-peop.json" --markdown "$OUT/$gpu-peop.md"
      ;;
    vit-eager)
      run_stage vit-eager 420 $bench --rows none --cases grid2d --vit-modes eager \
        --json "$OUT/$gpu-vit-eager.json" --markdown "$OUT/$gpu-vit-eager.md"
      ;;
    vit-compiled)
      run_stage vit-compiled 540 $bench --rows none --cases grid2d --vit-modes compiled \
        --compile-mode reduce-overhead --vit-pes axial mixed cayley circulant comrope-ld --no-timm \
        --json "$OUT/$gpu-vit-compiled.json" --markdown "$OUT/$gpu-vit-compiled.md"
      ;;
    costs)
      run_stage costs 90 python tools/step_costs.py --device cuda --steps 6 --warmup 2 --markdown "$OUT/$gpu-costs.md"
      ;;
    syncs)
      run_stage syncs 300 python tools/profile_step.py syncs none cayley circulant comrope-ld c:cayley
      ;;
    folded)  # 510 s of limits in all: fits a 9-minute command with the start-up to spare
      run_stage folded-tests 130 python -m pytest -q -rfs -p no:cacheprovider tests/test_sync_free_step.py \
        tests/test_skew_schur.py tests/test_nn_batched_bases.py
      run_stage folded-peop 80 $bench --quick --no-vit --cases grid2d --rows "cayley in training (folded)" \
        "circulant in training (folded)" "comrope-ld (b=8) in training (folded)" \
        --json "$OUT/$gpu-folded-peop.json" --markdown "$OUT/$gpu-folded-peop.md"
      run_stage folded-vit 300 $bench --quick --rows none --cases grid2d --vit base --vit-modes eager compiled \
        --compile-mode reduce-overhead --vit-pes axial mixed cayley circulant comrope-ld --no-timm \
        --json "$OUT/$gpu-folded-vit.json" --markdown "$OUT/$gpu-folded-vit.md"
      ;;
    *)
      echo "unknown stage '$stage': use all, new, checks, peop, vit-eager, vit-compiled, costs, syncs or folded" >&2
      exit 2
      ;;
  esac
done
tail -c 4000 "$log"
