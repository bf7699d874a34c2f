"""The notebooks run under the tests (pytest --nbmake) at their small size."""

import os

os.environ.setdefault("OTREG_NOTEBOOK_SIZE", "small")

# tests/docs/test_notebook_values.py runs this one whole (with a last cell that checks what
# it printed against POT's exact EMD): a second run here would add 13 s and check less
collect_ignore = ["02_ot_as_a_loss.ipynb"]
