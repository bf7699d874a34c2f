"""Sphinx configuration: the otreg documentation site (``bash scripts/docs.sh``).

Markdown pages through MyST, the API reference from the docstrings (Google style, read by
napoleon), the command-line reference from the click commands (sphinx-click). It builds
offline: no page loads anything from the network (the theme's assets are bundled; the
docstrings' LaTeX is rendered by the MathJax that sphinx-mathjax-offline ships and copies
into the site, instead of Sphinx's default MathJax from a CDN).
"""

from __future__ import annotations

import otreg

project = "otreg"
author = "the otreg developers"
copyright = "2026, the otreg developers"
release = version = otreg.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_click",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
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
