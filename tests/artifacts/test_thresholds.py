"""The artifacts guide's thresholds, pasted: 8-bit artifacts pass the defaults, 4-bit weight-only artifacts of every
tool pass the 4-bit settings, on the tests' tiny Llama."""

import pytest
from transformers import BitsAndBytesConfig, QuantoConfig

from qcore.artifact import ArtifactAnalysis
from tests.artifacts.checks import loaded_with
from tests.helpers import compressed_tensors_checkpoint, hqq_artifact, saved_llama, tiny_llama, token_batches

DEFAULTS = {"sqnr_min_db": 20, "model_sqnr_min_db": 20, "kl_max_nats": 0.02}
FOUR_BIT = {"sqnr_min_db": 5, "weight_sqnr_min_db": 15, "model_sqnr_min_db": 8, "kl_max_nats": 0.01}


ARTIFACTS = {
    "W8A8": (DEFAULTS, lambda reference, folder: compressed_tensors_checkpoint(reference, folder, "W8A8")),
    "bitsandbytes int8": (DEFAULTS, lambda reference, folder: loaded_with(saved_llama(reference, folder),
                                                                          BitsAndBytesConfig, "load_in_8bit=True")),
    "W4A16": (FOUR_BIT, lambda reference, folder: compressed_tensors_checkpoint(reference, folder, "W4A16",
                                                                                group_size=32)),
    "nf4": (FOUR_BIT, lambda reference, folder: loaded_with(saved_llama(reference, folder), BitsAndBytesConfig,
                                                            "load_in_4bit=True, bnb_4bit_quant_type='nf4'")),
    "quanto int4": (FOUR_BIT, lambda reference, folder: loaded_with(saved_llama(reference, folder), QuantoConfig,
                                                                    "weights='int4'")),
    "HQQ 4-bit": (FOUR_BIT, lambda reference, folder: hqq_artifact(reference)),
}


@pytest.mark.parametrize("artifact", ARTIFACTS)
def test_the_guides_thresholds_pass_an_artifact_of_their_family(tmp_path, artifact):
    settings, make = ARTIFACTS[artifact]
    reference = tiny_llama()
    analysis = ArtifactAnalysis(reference, make(reference, tmp_path / "artifact"), token_batches(), logits=True)
    layers = analysis.sqnr.layers.values()
    assert min(record.sqnr_db for record in layers) >= settings["sqnr_min_db"]
    assert min(record.weight_sqnr_db for record in layers) >= settings.get("weight_sqnr_min_db", 0)
    assert analysis.sqnr.worst_output().sqnr_db >= settings["model_sqnr_min_db"]
    assert analysis.logits.kl_nats <= settings["kl_max_nats"]
