"""KeOps can never take the process down: a stand-in pykeops whose first compile kills its
process (as pykeops 2.3 does on CUDA 13) is caught by the check in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE = """
import os, signal
__version__ = "VERSION"

def get_build_folder():
    return "/nowhere"
"""
FAKE_TORCH = """
import os, signal
with open(os.environ["FAKE_KEOPS_LOG"], "a") as log:
    log.write("compile\\n")

class LazyTensor:
    def __init__(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGSEGV)  # what pykeops 2.3 does in its nvrtc binding
"""

USER = textwrap.dedent(
    """
    import warnings, torch, otreg
    from otreg import reductions
    reductions.KEOPS_ON_CPU = True  # auto would pick KeOps on this CPU
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(2500, 3, generator=g), torch.rand(2500, 3, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = otreg.sinkhorn_divergence(x, y, blur=0.5, multiscale=False)
        d2 = otreg.sinkhorn_divergence(x, y, blur=0.5, multiscale=False)
    keops = [str(w.message) for w in caught if "blocked" in str(w.message)]
    print("WARNINGS", len(keops), keops[0] if keops else "")
    print("VALUE", float(d), float(d2))
    try:
        otreg.sinkhorn(x, y, blur=0.5, backend="keops", multiscale=False)
    except otreg.KeOpsUnavailable as err:
        print("RAISED", err)
    print("ALIVE")
    """
)


def fake_pykeops(root: Path, version: str) -> None:
    pkg = root / "pykeops"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(FAKE.replace("VERSION", version))
    (pkg / "torch.py").write_text(FAKE_TORCH)
    for old in root.glob("pykeops-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = root / f"pykeops-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pykeops\nVersion: {version}\n")


def run_user(root: Path, cache: Path, log: Path) -> str:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(root), *sys.path]),
        OTREG_CACHE_DIR=str(cache),
        FAKE_KEOPS_LOG=str(log),
    )
    done = subprocess.run(
        [sys.executable, "-c", USER], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # 30 s (the default run stays under 20 minutes)
def test_a_crashing_pykeops_is_caught_in_a_child_and_remembered(tmp_path):
    root, cache, log = tmp_path / "site", tmp_path / "cache", tmp_path / "compiles.log"
    fake_pykeops(root, "9.9.0")
    out = run_user(root, cache, log)
    assert "ALIVE" in out  # the user's process survived
    warned = out.split("WARNINGS ")[1]
    assert warned.startswith("1 ")  # one warning, not one a call
    assert "signal 11 (SIGSEGV)" in warned and "'blocked'" in warned
    raised = out.split("RAISED ")[1]
    assert "backend='keops' but pykeops killed its check process with signal 11" in raised
    values = [float(v) for v in out.split("VALUE ")[1].split()[:2]]
    assert values[0] == values[1] > 0  # computed by the next backend
    assert log.read_text().count("compile") == 1  # the check ran once, in a child
    saved = json.loads((cache / "keops-check.json").read_text())
    ((key, verdict),) = saved.items()
    assert json.loads(key)["pykeops"] == "9.9.0" and verdict[0] is False

    run_user(root, cache, log)  # the next process reads the verdict: no new check
    assert log.read_text().count("compile") == 1

    fake_pykeops(root, "9.9.1")  # an upgrade: checked again
    run_user(root, cache, log)
    assert log.read_text().count("compile") == 2
    assert len(json.loads((cache / "keops-check.json").read_text())) == 2


def test_the_check_passes_with_the_real_pykeops(tmp_path, monkeypatch):
    pytest.importorskip("pykeops")
    from otreg.reductions import _keops

    monkeypatch.setenv("OTREG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_keops, "_verdicts", {})
    import torch

    ok, reason = _keops.verdict(torch.device("cpu"))
    assert ok, reason
    assert (tmp_path / "keops-check.json").is_file()


def test_otreg_info_says_before_a_check_that_may_take_minutes(tmp_path, monkeypatch):
    """The first `otreg info` on a machine compiles KeOps' formulas (2.5 minutes for a new
    user, under load, with nothing said): a line on stderr says so first; a cached verdict
    says nothing."""
    pytest.importorskip("pykeops")
    import io

    import otreg
    from otreg.reductions import _keops

    monkeypatch.setenv("OTREG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_keops, "_verdicts", {})
    monkeypatch.setattr(_keops, "_check_in_a_child", lambda device: (True, "ok"))
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    otreg.info(file=io.StringIO())
    assert "checking KeOps on cpu: compiling otreg's formulas" in err.getvalue()
    monkeypatch.setattr(_keops, "_verdicts", {})  # a new process: the file's verdict
    err.truncate(0)
    otreg.info(file=io.StringIO())
    assert "checking KeOps" not in err.getvalue()


def test_a_call_with_backend_keops_says_before_its_check(tmp_path, monkeypatch):
    """``backend="keops"`` on a machine without a verdict waited 134 s in silence while the
    child process compiled: the same line as ``otreg info``'s comes first."""
    import io

    import torch

    import otreg
    from otreg.reductions import _keops

    monkeypatch.setenv("OTREG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_keops, "_verdicts", {})
    monkeypatch.setattr(_keops, "status", lambda: (True, "ok"))
    monkeypatch.setattr(_keops, "_check_in_a_child", lambda device: (False, "a stand-in"))
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    x, y = torch.rand(30, 3), torch.rand(40, 3)
    with pytest.raises(otreg.KeOpsUnavailable, match="a stand-in"):
        otreg.sinkhorn(x, y, backend="keops", multiscale=False)
    assert "otreg: checking KeOps on cpu: compiling otreg's formulas" in err.getvalue()
