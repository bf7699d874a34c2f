"""Sphinx configuration: the otreg documentation site (``bash scripts/docs.sh``).

Markdown pages through MyST, the API reference from the docstrings (Google style, read by
napoleon), the command-line reference from the click commands (sphinx-click). It builds
offline: no page loads anything from the network (the theme's assets are bundled; the
docstrings' LaTeX is rendered by the MathJax that sphinx-mathjax-offline ships and copies
into the site, instead of Sphinx's default MathJax from a CDN).
"""

from __future__ import annotations

import os

import otreg

project = "otreg"
author = "the otreg developers"
copyright = "2026, the otreg developers"
release = version = otreg.__version__

extensions = [
    "myst_nb",  # MyST Markdown pages and the notebooks (notebooks/, linked here)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_click",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",
]
root_doc = "index"
exclude_patterns = ["_build", "README.md", "notebooks/conftest.py", "**/.ipynb_checkpoints"]
# The notebooks are committed without outputs and run while the site builds, at the size
# OTREG_NOTEBOOK_SIZE says (scripts/docs.sh: full, the sizes the text quotes); the tests run them
# separately (pytest --nbmake) and build the site with OTREG_DOCS_EXECUTE=off.
nb_execution_mode = os.environ.get("OTREG_DOCS_EXECUTE", "force")
nb_execution_timeout = 1800
nb_execution_raise_on_error = True
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False
suppress_warnings = ["myst.xref_missing"]

html_theme = "furo"
html_title = f"otreg {release}"
html_static_path: list[str] = []
