"""Example model repository: five models declared for `pytest --qreport examples/`.

Set QREPORT_EXAMPLES_FAILING=1 to also declare four models that show the gate at work (5 failing items):
`wide_rows_mlp`, quantized per tensor, with one layer whose weight rows span two orders of magnitude (its
per_channel item fails with the layer_overrides measured to fix it), `spiky_mlp`, whose input has rare huge
spikes in one channel (torch.ao's outlier heuristic flags them, but a clipping observer was measured not to
help, so its items pass with a note),
`sensor_mlp_unequalized`, whose input channels span four orders of magnitude and which is not equalized
(its first layer's equalization item fails with the fix measured within the fix budget), and `fragile`, whose
output SQNR fails: its model_sqnr item ends with a float_layers list, measured to pass, to paste into qmodel.
"""
import os

import pytest
import torch
from models import (
    MLP,
    VOCABULARY,
    TinyEncoder,
    TinyResNet,
    WordTokenizer,
    fragile_mlp,
    seeded,
    sentences,
    settle_batchnorm,
    wide_rows,
)

from pytest_qreport import qmodel

# torch.ao's input-weight equalization detector recommends equalization for almost every well-balanced layer.
# Each recommendation is measured before it is advised: here none gains 1 dB (several lose 1.5 dB), so those
# items pass with a note that names both (pytest --qreport examples/ --qreport-table=all shows them).


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


# Random weights leave its 10 logits within about 1e-3 of each other, so int8 noise flips the argmax of about one
# image in nine although the KL divergence is 5e-7 nats; a trained classifier's margins are far wider.
@qmodel(calibration="image_batches", top1_agreement_min=0.85)
def tiny_resnet():
    g = _generator(10)
    return settle_batchnorm(seeded(TinyResNet), [torch.randn(16, 3, 32, 32, generator=g) for _ in range(4)])


# ReLU outputs are sparse: their 97.5th percentile is tiny next to the max, which the outlier detector
# flags; a histogram observer clips such ranges by error, so this model uses one (as the outlier items advise).
@qmodel(calibration="feature_batches", quantizer="int8_histogram")
def mlp():
    return seeded(MLP)


# smoothing its attention output projections into the value projections raises their own SQNR by 1.2-1.3 dB in
# the comparison pass (under 1 dB on the whole smoothed model): this team asks equalization for 1.5 dB.
@qmodel(calibration="token_batches", quantizer="int8_histogram", equalization_min_gain_db=1.5)
def tiny_encoder():
    return seeded(TinyEncoder)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """Like loading a tokenizer from its files: set up once per session, cleaned up at the end."""
    path = tmp_path_factory.mktemp("tokenizer") / "vocab.txt"
    path.write_text("\n".join(VOCABULARY), encoding="utf-8")
    yield WordTokenizer(str(path))
    path.unlink()


@pytest.fixture
def sentence_batches(tokenizer):
    return [tokenizer(sentences(8, seed), length=24) for seed in range(6)]


# A model whose calibration fixture needs another fixture (the tokenizer): qmodel resolves it at collection
# and at run time through pytest's own fixture machinery, teardown included.
@qmodel(calibration="sentence_batches", quantizer="int8_histogram", checks="sqnr,model_sqnr")
def text_classifier():
    return seeded(lambda: TinyEncoder(vocab=len(VOCABULARY) + 2, dim=32, heads=2, layers=1, max_tokens=24))


@pytest.fixture
def sensor_batches():
    g = _generator(4)
    spread = torch.logspace(-2, 2, 32)  # input channels span four orders of magnitude
    return [torch.randn(64, 32, generator=g) * spread for _ in range(8)]


# Input-weight equalization balances the input channels before quantization (+3 to +6 dB per layer here);
# the equalization_equivalence item checks that the equalized float model still computes the same function.
@qmodel(calibration="sensor_batches", equalize=True, quantizer="int8_histogram")
def sensor_mlp():
    return seeded(lambda: MLP(features=32, hidden=64, classes=8))


@pytest.fixture
def spiky_batches():
    g = _generator(3)
    batches = []
    for _ in range(8):
        x = torch.randn(32, 64, generator=g)
        x[torch.randint(0, 32, (1,), generator=g), 7] = 150.0  # rare spikes in input channel 7
        batches.append(x)
    return batches


if os.environ.get("QREPORT_EXAMPLES_FAILING") == "1":

    # per-tensor weights, and one layer whose weight rows span two orders of magnitude. torch.ao's per-channel
    # heuristic names every layer, but per-channel weights were measured to gain 1 dB on layers.2 only, so that
    # item alone fails, with the layer_overrides to paste; the others pass with a note.
    @qmodel(calibration="feature_batches", quantizer="int8_per_tensor", checks="per_channel,model_sqnr")
    def wide_rows_mlp():
        return wide_rows()

    # spikes in one input channel: torch.ao's outlier heuristic flags the layers they reach, but a clipping
    # (histogram) observer was measured not to help (clipping a spike costs more than the finer scale saves), so
    # the outlier items pass with a note that names both
    @qmodel(calibration="spiky_batches", checks="outlier,model_sqnr", layers="layers.0,layers.2,output")
    def spiky_mlp():
        return seeded(MLP)

    # the sensor model without equalization: input-weight equalization raises its first layer's own SQNR by 5.9 dB
    # in the comparison pass, so that item fails; within the fix budget, equalize=['layers.0'] was measured to
    # raise the output SQNR 31.3 -> 34.2 dB (fix_budget=2 also measures equalize=True: 34.7 dB)
    @qmodel(calibration="sensor_batches", quantizer="int8_histogram")
    def sensor_mlp_unequalized():
        return seeded(lambda: MLP(features=32, hidden=64, classes=8))

    # its model_sqnr item fails and ends with the float_layers that were measured to fix it; the sensitivity
    # item ranks the layers
    @qmodel(calibration="feature_batches", checks="sqnr,model_sqnr,sensitivity")
    def fragile():
        return fragile_mlp()
