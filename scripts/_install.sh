# Sourced by main.sh and test.sh: install otreg (with the extras given) into the current Python.
# torch==2.13.0 (CPU) first when no torch is importable: an open range could pull a CUDA build.
set -euo pipefail
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[$1]"
