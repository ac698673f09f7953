#!/usr/bin/env bash
# The expert's success against its belief error in the target's height (40 in-distribution scenes per offset),
# for the current grasp (press 2 cm in, suction on from 3 cm above) and for closing on the top face.
set -euo pipefail
cd "$(dirname "$0")"
OFFSETS="-0.03 -0.02 -0.01 0 0.01 0.015 0.02 0.03 0.04"
ropekit robot diagnose tolerance --axis z --offsets $OFFSETS --episodes 40 --out tolerance_z_press.json
ropekit robot diagnose tolerance --axis z --offsets $OFFSETS --episodes 40 --press-depth 0 --suction-height 0 \
    --out tolerance_z_close_on_top.json
