"""What the command-line tests share: click's runner and two small meshes."""

import pytest
import torch
from click.testing import CliRunner

from otreg import Shape, save_shape
from otreg.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def two_meshes(tmp_path):
    pts = torch.tensor([[0.0, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]])
    faces = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
    a = save_shape(Shape(pts, faces), tmp_path / "a.vtk")
    b = save_shape(Shape(pts + torch.tensor([3.0, 0, 0]), faces), tmp_path / "b.ply")
    return str(a), str(b)
