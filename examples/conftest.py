"""Example model repository: three models declared for `pytest --qreport examples/`."""
import pytest
import torch

from models import MLP, TinyEncoder, TinyResNet, seeded, settle_batchnorm
from pytest_qreport import qmodel


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def image_batches():
    g = _generator(0)
    return [torch.randn(8, 3, 32, 32, generator=g) for _ in range(8)]


@pytest.fixture
def feature_batches():
    g = _generator(1)
    return [torch.randn(32, 64, generator=g) for _ in range(8)]


@pytest.fixture
def token_batches():
    g = _generator(2)
    batches = []
    for _ in range(6):
        ids = torch.randint(0, 1000, (8, 32), generator=g)
        mask = torch.ones(8, 32, dtype=torch.long)
        mask[:, 24:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


@qmodel(calibration="image_batches")
def tiny_resnet():
    g = _generator(10)
    return settle_batchnorm(seeded(TinyResNet), [torch.randn(16, 3, 32, 32, generator=g) for _ in range(4)])


@qmodel(calibration="feature_batches")
def mlp():
    return seeded(MLP)


@qmodel(calibration="token_batches")
def tiny_encoder():
    return seeded(TinyEncoder)
