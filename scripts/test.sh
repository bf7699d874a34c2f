#!/usr/bin/env bash
# Install otreg with its test dependencies (POT, GeomLoss) and run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh test
"${PYTHON:-python3}" -m pytest --durations=15 "$@"
