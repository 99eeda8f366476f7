"""What each tool's artifact measures, to set thresholds from: a small Llama (seeded random weights, default config
otherwise) quantized by each tool's own API in each of its formats, gated against its float reference on the same
token batches, every number qcore's (qcore.artifact.ArtifactAnalysis).

    python benchmarks/bench_tools.py                    # 4 blocks, hidden 256
    python benchmarks/bench_tools.py --hidden 512 --layers 8

Prints, per artifact: its per-layer SQNR (lowest, median), weight SQNR (lowest, median), the output SQNR, the KL
divergence of the logits and their top-1 agreement. Random weights have no outlier channels, so a real model's 8-bit
layers measure lower than these: read the gaps between formats, and set thresholds a few dB under what your own
artifact measures.
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))


def reference_llama(hidden: int, layers: int) -> Any:
    """A Llama of `layers` blocks of width `hidden` with seeded weights (the float reference)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128))
    return LlamaForCausalLM(config).eval()


def token_batches(count: int = 4, tokens: int = 64) -> list[dict]:
    """Causal-LM batches of random token ids."""
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 1024, (2, tokens), generator=generator)} for _ in range(count)]


def _calibrate(model: Any, batches: list[dict]) -> None:
    with torch.no_grad():
        for batch in batches:
            model(**batch)


def makers(folder: pathlib.Path, batches: list[dict]) -> dict[str, Callable[[Any], Any]]:
    """{artifact: a function of the reference returning it, made by its tool's own API}."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, QuantoConfig

    def transformers_loaded(config: Any) -> Callable[[Any], Any]:
        def make(reference: Any) -> Any:
            reference.save_pretrained(folder / "float")
            return AutoModelForCausalLM.from_pretrained(folder / "float", quantization_config=config,
                                                        device_map="cpu").eval()
        return make

    def modelopt(name: str) -> Callable[[Any], Any]:
        def make(reference: Any) -> Any:
            import modelopt.torch.quantization as mtq

            return mtq.quantize(copy.deepcopy(reference), copy.deepcopy(getattr(mtq, name)),
                                lambda model: _calibrate(model, batches)).eval()
        return make

    def hqq(bits: int) -> Callable[[Any], Any]:
        from tests.helpers import hqq_artifact

        return lambda reference: hqq_artifact(reference, bits)

    def compressed_tensors(preset: str) -> Callable[[Any], Any]:
        def make(reference: Any) -> Any:
            from tests.helpers import compressed_tensors_checkpoint

            return compressed_tensors_checkpoint(reference, folder / preset, preset,
                                                 group_size=128 if preset == "W4A16" else None)
        return make

    def gptq(reference: Any) -> Any:
        from tests.helpers import gptq_artifact

        return gptq_artifact(reference, folder, "bits=4, group_size=128", batches)

    return {
        "compressed-tensors W8A8": compressed_tensors("W8A8"),
        "compressed-tensors W4A16 group 128": compressed_tensors("W4A16"),
        "ModelOpt INT8": modelopt("INT8_DEFAULT_CFG"),
        "ModelOpt INT8 SmoothQuant": modelopt("INT8_SMOOTHQUANT_CFG"),
        "ModelOpt FP8": modelopt("FP8_DEFAULT_CFG"),
        "ModelOpt INT4 AWQ": modelopt("INT4_AWQ_CFG"),
        "bitsandbytes int8": transformers_loaded(BitsAndBytesConfig(load_in_8bit=True)),
        "bitsandbytes nf4": transformers_loaded(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")),
        "quanto int8": transformers_loaded(QuantoConfig(weights="int8")),
        "quanto int4": transformers_loaded(QuantoConfig(weights="int4")),
        "HQQ 8-bit group 64": hqq(8),
        "HQQ 4-bit group 64": hqq(4),
        "GPTQModel 4-bit group 128": gptq,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from qcore.artifact import ArtifactAnalysis

    batches = token_batches()
    reference = reference_llama(args.hidden, args.layers)
    print(f"Llama, {args.layers} blocks of width {args.hidden}, {len(batches)} batches of 2 x 64 tokens")
    print(f"{'artifact':<36} {'layer SQNR min/median':>22} {'weight SQNR min/median':>23} {'output SQNR':>12} "
          f"{'KL nats':>9} {'top-1':>6}")
    with tempfile.TemporaryDirectory() as folder:
        for name, make in makers(pathlib.Path(folder), batches).items():
            analysis = ArtifactAnalysis(reference, make(reference), batches, logits=True)
            layers = [record.sqnr_db for record in analysis.sqnr.layers.values()]
            weights = [record.weight_sqnr_db for record in analysis.sqnr.layers.values()
                       if record.weight_sqnr_db is not None]
            output = analysis.sqnr.worst_output().sqnr_db
            logits = analysis.logits
            print(f"{name:<36} {min(layers):>10.1f} / {statistics.median(layers):>5.1f} dB "
                  f"{min(weights):>10.1f} / {statistics.median(weights):>5.1f} dB {output:>9.1f} dB "
                  f"{logits.kl_nats:>9.4f} {logits.top1_agreement:>6.3f}")


if __name__ == "__main__":
    main()
