"""The otreg command group: info, and errors that name the file or option."""

import re

from click.testing import CliRunner

from otreg.cli import main
from tests.cli.conftest import run


def test_info():
    from otreg.reductions import _compiled

    result = run("info", "--no-keops")
    assert result.exit_code == 0 and "backends:" in result.output and "tensorized" in result.output
    # where the fused loops' verdicts are kept (delete the file to measure again)
    assert f"compiled loops verdicts:           {_compiled.verdict_file()}" in result.output


def test_cli_errors_name_the_file_or_option(two_meshes, tmp_path):
    import numpy as np

    cloud = tmp_path / "cloud.npy"
    np.save(cloud, np.random.default_rng(0).random((50, 3)))
    result = CliRunner().invoke(
        main, ["register", str(cloud), two_meshes[1], "-o", str(tmp_path / "o")]
    )
    assert (
        result.exit_code == 1 and "cloud.npy" in result.output and "no triangles" in result.output
    )
    seg = tmp_path / "seg.nii.gz"
    seg.write_bytes(b"x")
    result = CliRunner().invoke(
        main, ["distance", str(seg), two_meshes[1], "--label", "1", "--level", "0.5"]
    )
    assert result.exit_code == 1 and "--level (a threshold" in result.output
    assert "not both" in result.output


def test_every_help_text_is_formatted():
    """No unformatted placeholder or doubled percent sign reaches a user."""
    for name in main.commands:
        text = run(name, "--help").output
        # {a|b} is click's own notation for choices
        assert not re.search(r"\{[^}|]*\}", text) and "%%" not in text, (name, text)
        assert "Usage:" in text
