#!/usr/bin/env bash
# Install otreg and run the main job. Until registration lands, the main job is the seed
# problem: OT between two circles of 10,000 points, its value and gradient (`otreg demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh all
otreg info --no-keops
otreg demo "$@"
