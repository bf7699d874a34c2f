"""The notebooks run under the tests (pytest --nbmake) at their small size."""

import os

os.environ.setdefault("OTREG_NOTEBOOK_SIZE", "small")
