import pytest
import torch


@pytest.fixture(scope="session")
def pial_small():
    pytest.importorskip("nilearn")
    pytest.importorskip("pyvista")
    from otreg import datasets

    return datasets.fsaverage5("pial", "left").to(torch.float64).decimate(800)
