#!/usr/bin/env bash
# Install otreg and run the main job: register fsaverage5's left midthickness surface onto
# Conte69's (`otreg demo`; options, e.g. --hemi right or --pair synthetic, are passed on) and
# write the results and a picture to otreg-demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh mesh,data
"$PY" -m otreg info --no-keops
"$PY" -m otreg demo "$@"
