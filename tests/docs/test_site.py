"""The documentation site builds offline with warnings as errors, and loads nothing from
the network."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")
pytest.importorskip("sphinx_click")

DOCS = Path(__file__).resolve().parents[2] / "docs"
NOTEBOOKS = DOCS.parent / "notebooks"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    env = {**os.environ, "OTREG_DOCS_EXECUTE": "off"}  # the notebooks run under nbmake
    proc = subprocess.run([*cmd, str(DOCS), str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_every_page_is_built(site):
    for page in ("index", "getting-started", "guide", "batch", "api", "cli", "benchmarks"):
        assert (site / f"{page}.html").is_file(), page
    for nb in NOTEBOOKS.glob("*.ipynb"):
        assert (site / "notebooks" / f"{nb.stem}.html").is_file(), nb.name


def test_the_site_loads_nothing_from_the_network(site):
    for page in site.rglob("*.html"):
        text = page.read_text()
        external = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?:)?//[^"]*"', text)
        assert not external, (page.name, external)
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()  # math, bundled


def test_the_references_hold_the_public_names(site):
    api = (site / "api.html").read_text()
    for name in ("otreg.sinkhorn", "otreg.register", "otreg.datasets.conte69", "FoldWarning"):
        assert name in api, name
    cli = (site / "cli.html").read_text()
    for command in ("demo", "register", "batch", "bids", "distance"):
        assert f'id="otreg-{command}"' in cli, command  # a section a command


def test_notebooks_are_committed_without_outputs():
    import json

    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(notebooks) >= 4
    for path in notebooks:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, path.name
