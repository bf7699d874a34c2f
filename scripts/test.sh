#!/usr/bin/env bash
# Install otreg with its test dependencies (POT, GeomLoss) and run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh test
# The batch report's tests open the group page in a real headless browser (Debian's chromium);
# install it where we may (root with apt), else those tests skip and say so.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }) \
        || echo "note: chromium could not be installed; the browser tests will skip" >&2
fi
"${PYTHON:-python3}" -m pytest --durations=15 "$@"
