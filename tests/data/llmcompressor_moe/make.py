"""Makes the llm-compressor 0.14 checkpoints of a tiny Qwen3-MoE that tests/artifacts/test_llmcompressor_moe.py gates.

Run it in a virtual environment of its own (llm-compressor pins compressed-tensors 0.19 and transformers 5.17; the
project's environment has 0.20 and 5.24):

    python3 -m venv .venv-llmcompressor && .venv-llmcompressor/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    .venv-llmcompressor/bin/python tests/data/llmcompressor_moe/make.py

That environment has no torchvision, which llm-compressor does not need: transformers 5.17 imports it when it is
installed (through image_processing_aria, on the MoE linearization path), and a torchvision built for another
torch breaks that import. Writes `reference/` (the float model) and one folder per recipe beside this file.
"""
import pathlib
import shutil
import sys

import torch
import transformers
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository, for tests.models
from tests.models import tiny_moe  # noqa: E402

IGNORE = ["lm_head", "re:.*mlp.gate$"]  # the routers stay in float, as llm-compressor's MoE examples keep them
UNREACHED = 2  # the router never chooses this expert (its logit is 0 where two others are above it)


def reference():
    """tests.models.tiny_moe's seeded one-block Qwen3-MoE with 5 experts, top-2, whose expert 2 no token reaches."""
    model = tiny_moe("qwen3_moe", layers=1, experts=5)[0]
    with torch.no_grad():
        router = model.model.layers[0].mlp.gate.weight  # logits (a, -a, 0, b, -b): the top-2 is never expert 2
        router[1], router[UNREACHED], router[4] = -router[0], 0.0, -router[3]
    return model


def calibration():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (32, 16), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


RECIPES = {
    "w4a16": (QuantizationModifier(targets="Linear", scheme="W4A16", ignore=IGNORE), True),
    "gptq_w4a16": (GPTQModifier(targets="Linear", scheme="W4A16", ignore=IGNORE), False),  # experts as routed
    "fp8_dynamic": (QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=IGNORE), True),
    "nvfp4": (QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=IGNORE), True),
}

if __name__ == "__main__":
    shutil.rmtree(HERE / "reference", ignore_errors=True)
    reference().save_pretrained(HERE / "reference")
    for name, (recipe, every_expert) in RECIPES.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(HERE / "reference").eval()
        oneshot(model=model, dataset=calibration(), recipe=recipe, num_calibration_samples=32, max_seq_length=16,
                moe_calibrate_all_experts=every_expert)
        shutil.rmtree(HERE / name, ignore_errors=True)
        model.save_pretrained(HERE / name, save_compressed=True)
