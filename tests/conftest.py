"""Shared test helpers."""
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.ao")
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def forbid_host_sync(monkeypatch):
    """Make Tensor.item()/.cpu()/.tolist() raise, to prove a code path never copies to the host."""

    def refuse(*args, **kwargs):
        raise AssertionError("host copy on a streaming path")

    for name in ("item", "cpu", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    yield
