#!/usr/bin/env bash
# How long must a detect3d model train? Seed 0 of the study's recipe (Cayley-STRING ViTD; an APE ViTD and an
# axial RGB ViT for comparison; the 9600- and 19200-step pairs on seeds 1 and 2 too) trained on different schedules,
# then the study's other questions at the longest one (RGB ViTs, depth as input only, every other encoding's ViTD;
# three seeds each); every training field that differs between them is stated on its line, so the lines do not
# depend on the preset's current schedule. About 24 CPU-hours in all (one thread per run; each 9600-step run takes
# 20-25 minutes, each 19200-step run 21-37 minutes with one run per core);
# summarise.py writes table.md, schedule.png, plateau.png and the README's grid block from the run folders (metrics.json,
# curve.csv, config.json).
# The committed b32-s300 files are the earlier study recipe's own seed-0 run (the same settings), copied, not
# retrained. Run from anywhere: it works from the repository root, where the scene cache (.cache/scenes) lives.
set -euo pipefail
here=docs/results/detect3d/schedule
cd "$(dirname "$0")/../../../.."
run() {  # run NAME ENCODING INPUT STEPS BATCH LR WARMUP LOG_EVERY [SEED, default 0]: trains from scratch, keeps
  local out="$here/$1"  # the run files
  rm -rf "$out"
  python -m ropekit_studies.detection --encodings "$2" --inputs "$3" --seeds "${9:-0}" --threads 1 --no-progress \
    --out "$out" --set train.steps="$4" --set train.batch_size="$5" --set train.lr="$6" \
    --set train.warmup_steps="$7" --set train.log_every="$8"
  find "$out" -maxdepth 1 -type f -delete  # the one-run report (table, plots); summarise.py writes the comparison
  rm -f "$out"/runs/*/model.pt
}
run b32-s300      cayley rgbd  300 32 0.001  30  25
run b16-s600      cayley rgbd  600 16 0.001  60  50
run b16-s1200     cayley rgbd 1200 16 0.001  60  50
run b16-s2400     cayley rgbd 2400 16 0.001 100 100
run b32-s1200     cayley rgbd 1200 32 0.001  60 100
run b32-s1200-lr3e-4 cayley rgbd 1200 32 0.0003 60 100
run b32-s1200-lr5e-4 cayley rgbd 1200 32 0.0005 60 100
run b32-s1200-lr2e-3 cayley rgbd 1200 32 0.002  60 100
run b64-s600-lr2e-3  cayley rgbd  600 64 0.002  60  50
run b32-s2400     cayley rgbd 2400 32 0.001 100 100
run b32-s4800     cayley rgbd 4800 32 0.001 100 200
run b32-s9600     cayley rgbd 9600 32 0.001 100 400
run ape-b32-s4800 absolute rgbd 4800 32 0.001 100 200
run ape-b32-s9600 absolute rgbd 9600 32 0.001 100 400
# the 9600-step comparison on two more seeds
run b32-s9600-seed1     cayley   rgbd 9600 32 0.001 100 400 1
run ape-b32-s9600-seed1 absolute rgbd 9600 32 0.001 100 400 1
run b32-s9600-seed2     cayley   rgbd 9600 32 0.001 100 400 2
run ape-b32-s9600-seed2 absolute rgbd 9600 32 0.001 100 400 2
run rgb-b16-s2400 axial  rgb  2400 16 0.001 100 100
# where does the IoU level off? The pair on twice the longest schedule (76.8 epochs), seeds 0-2; 25-30 min each
run b32-s19200     cayley   rgbd 19200 32 0.001 100 800
run ape-b32-s19200 absolute rgbd 19200 32 0.001 100 800
run b32-s19200-seed1     cayley   rgbd 19200 32 0.001 100 800 1
run ape-b32-s19200-seed1 absolute rgbd 19200 32 0.001 100 800 1
run b32-s19200-seed2     cayley   rgbd 19200 32 0.001 100 800 2
run ape-b32-s19200-seed2 absolute rgbd 19200 32 0.001 100 800 2
# the study's other questions at that length: the RGB ViT (Cayley, APE) and depth as input only (Cayley); 23-28 min each
run rgb-b32-s19200           cayley   rgb          19200 32 0.001 100 800
run ape-rgb-b32-s19200       absolute rgb          19200 32 0.001 100 800
run ch-b32-s19200            cayley   rgbd-channel 19200 32 0.001 100 800
run rgb-b32-s19200-seed1     cayley   rgb          19200 32 0.001 100 800 1
run ape-rgb-b32-s19200-seed1 absolute rgb          19200 32 0.001 100 800 1
run ch-b32-s19200-seed1      cayley   rgbd-channel 19200 32 0.001 100 800 1
run rgb-b32-s19200-seed2     cayley   rgb          19200 32 0.001 100 800 2
run ape-rgb-b32-s19200-seed2 absolute rgb          19200 32 0.001 100 800 2
run ch-b32-s19200-seed2      cayley   rgbd-channel 19200 32 0.001 100 800 2
# every other encoding's ViTD (depth as input and as coordinate) at that length, seeds 0-2
# (22-30 min each)
run none-b32-s19200           none      rgbd 19200 32 0.001 100 800
run axial-b32-s19200          axial     rgbd 19200 32 0.001 100 800
run mixed-b32-s19200          mixed     rgbd 19200 32 0.001 100 800
run circulant-b32-s19200      circulant rgbd 19200 32 0.001 100 800
run none-b32-s19200-seed1     none      rgbd 19200 32 0.001 100 800 1
run axial-b32-s19200-seed1    axial     rgbd 19200 32 0.001 100 800 1
run mixed-b32-s19200-seed1    mixed     rgbd 19200 32 0.001 100 800 1
run circulant-b32-s19200-seed1 circulant rgbd 19200 32 0.001 100 800 1
run none-b32-s19200-seed2     none      rgbd 19200 32 0.001 100 800 2
run axial-b32-s19200-seed2    axial     rgbd 19200 32 0.001 100 800 2
run mixed-b32-s19200-seed2    mixed     rgbd 19200 32 0.001 100 800 2
run circulant-b32-s19200-seed2 circulant rgbd 19200 32 0.001 100 800 2
# every other encoding's RGB ViT at that length, seeds 0-2 (Circulant 0-1); 21-27 min each
run axial-rgb-b32-s19200           axial     rgb 19200 32 0.001 100 800
run none-rgb-b32-s19200            none      rgb 19200 32 0.001 100 800
run mixed-rgb-b32-s19200           mixed     rgb 19200 32 0.001 100 800
run circulant-rgb-b32-s19200       circulant rgb 19200 32 0.001 100 800
run axial-rgb-b32-s19200-seed1     axial     rgb 19200 32 0.001 100 800 1
run none-rgb-b32-s19200-seed1      none      rgb 19200 32 0.001 100 800 1
run mixed-rgb-b32-s19200-seed1     mixed     rgb 19200 32 0.001 100 800 1
run circulant-rgb-b32-s19200-seed1 circulant rgb 19200 32 0.001 100 800 1
run axial-rgb-b32-s19200-seed2     axial     rgb 19200 32 0.001 100 800 2
run mixed-rgb-b32-s19200-seed2     mixed     rgb 19200 32 0.001 100 800 2
run none-rgb-b32-s19200-seed2      none      rgb 19200 32 0.001 100 800 2
# every other rotary encoding with depth as input only at that length, seeds 0-2, and the Circulant RGB ViT's
# third seed (25-37 min each)
run axial-ch-b32-s19200            axial     rgbd-channel 19200 32 0.001 100 800
run mixed-ch-b32-s19200            mixed     rgbd-channel 19200 32 0.001 100 800
run axial-ch-b32-s19200-seed1      axial     rgbd-channel 19200 32 0.001 100 800 1
run mixed-ch-b32-s19200-seed1      mixed     rgbd-channel 19200 32 0.001 100 800 1
run circulant-ch-b32-s19200        circulant rgbd-channel 19200 32 0.001 100 800
run circulant-ch-b32-s19200-seed1  circulant rgbd-channel 19200 32 0.001 100 800 1
run axial-ch-b32-s19200-seed2      axial     rgbd-channel 19200 32 0.001 100 800 2
run mixed-ch-b32-s19200-seed2      mixed     rgbd-channel 19200 32 0.001 100 800 2
run circulant-ch-b32-s19200-seed2  circulant rgbd-channel 19200 32 0.001 100 800 2
run circulant-rgb-b32-s19200-seed2 circulant rgb          19200 32 0.001 100 800 2
python "$here/summarise.py"
