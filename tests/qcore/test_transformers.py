"""A BERT-style transformers model (random weights, kwargs inputs): every Linear gets an sqnr finding."""
import pytest
import torch

import qcore
from qcore.analysis import measure_sqnr, quantized_layers
from tests.helpers import padded_token_batches

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert():
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    return model, padded_token_batches(3, 4, 16, padded_from=12, vocabulary=128, seed=0)


def test_every_linear_of_bert_gets_an_sqnr_record(bert):
    model, data = bert
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    float_gm = qcore.capture(model, data[0], name="bert")
    layers = [entry.layer for entry in quantized_layers(float_gm)]
    assert set(linears) <= set(layers)
    measured = measure_sqnr(float_gm, data)
    for name in linears:
        assert measured.layers[name].sqnr_db > 10
        assert measured.layers[name].weight_sqnr_db > 30
    assert measured.outputs


def test_plugin_collects_an_sqnr_item_for_every_bert_linear(bert):
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.registry import CheckRegistry
    from pytest_qreport.core.settings import ModelSettings

    model, data = bert
    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    settings = ModelSettings.defaults(BUILTIN_CHECKS, checks=["sqnr", "outlier"], calibration=data)
    state = collect_model("bert", settings, registry, qcore.Int8StaticQuantizer(), model, data[0])
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert set(linears) <= set(state.items["sqnr"])
    assert set(linears) <= set(state.items["outlier"])


def test_model_report_covers_every_bert_linear(bert):
    from qcore.graph.inputs import call_model
    from qcore.report import DynamicStaticDetector, InputWeightEqualizationDetector, ModelReport, OutlierDetector

    model, data = bert
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    report = ModelReport(model, [DynamicStaticDetector(), InputWeightEqualizationDetector(0.5), OutlierDetector()],
                         example_inputs=data[0])
    observed = report.prepare_detailed_calibration()
    with torch.no_grad():
        for batch in data:
            call_model(observed, batch)
    reports = report.generate_model_report(remove_inserted_observers=True)
    for name, (_, per_layer) in reports.items():
        assert set(linears) <= set(per_layer), name
    hidden = model.config.hidden_size
    assert len(reports["outlier_detector"][1]["encoder.layer.0.attention.self.query"]["outliers_detected"]) == hidden


def test_a_smaller_last_batch_is_named_with_the_size_the_model_was_captured_for_and_dropping_it_works():
    from tests.models import tiny_llama

    model, data = tiny_llama(layers=1)
    smaller = {key: value[:2] for key, value in data[-1].items()}  # a dataset that does not divide by the batch
    float_gm = qcore.capture(model, data[0], name="llama")
    with pytest.raises(qcore.CalibrationError) as failed:
        measure_sqnr(float_gm, [*data, smaller])
    message = str(failed.value)
    assert "calibration batch 3 of 4 failed" in message
    assert message.endswith("It differs from the first batch in its batch size alone (2 rows against 4), and the "
                            "captured model computes with the first batch's size: give every batch that size (a "
                            "DataLoader's drop_last=True drops a smaller last batch).")
    measured = measure_sqnr(float_gm, data)  # the advice, taken: the smaller last batch dropped
    assert measured.layers and all(entry.batches == len(data) for entry in measured.layers.values())
