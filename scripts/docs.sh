#!/usr/bin/env bash
# Build the documentation site into docs/_build/html (offline, warnings as errors).
# Extra arguments go to sphinx-build, e.g. `bash scripts/docs.sh -b linkcheck`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh docs
# the notebooks run while the site builds, at the size their text and the README quote
# (OTREG_NOTEBOOK_SIZE=small for a quick check: the tests run them so)
export OTREG_NOTEBOOK_SIZE=${OTREG_NOTEBOOK_SIZE:-full}
"$PY" -m sphinx -W --keep-going -b html docs docs/_build/html "$@"
echo "open docs/_build/html/index.html"
