"""An artifact gated one block at a time (qcore.artifact.blockwise) gives the whole pass's numbers, bit for bit, for
models loaded whole and for models loaded with accelerate's big-model offload (weights on the meta device, read from
the checkpoint or the offload folder one block at a time); compressed-tensors layers are decompressed with their
block and compressed again after it."""
import shutil

import pytest
import torch
from torchao.quantization import Int8DynamicActivationInt8WeightConfig

from qcore.artifact import (
    ArtifactAnalysis,
    ArtifactError,
    BlockwiseArtifactError,
    artifact_layers,
    artifact_stack,
    measure_artifact,
    measure_artifact_blockwise,
    state_digest,
)
from qcore.artifact.blockwise import StreamRecord, resume_artifact_blockwise, start_block
from qcore.artifact.offload import is_offloaded, module_tensor, onloaded
from tests.helpers import float_and_w4a16_checkpoints, token_batches, torchao_artifact

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 4-layer tiny Llama saved in float, and its W4A16 compressed-tensors checkpoint."""
    return float_and_w4a16_checkpoints(tmp_path_factory.mktemp("checkpoints"))


def _whole(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _offloaded(path, folder):
    """As a small machine loads a big model: most of it to disk, behind accelerate's hooks."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory={"cpu": "150KiB"},
                                                offload_folder=str(folder)).eval()


def _same(whole, blockwise):
    assert list(whole.sqnr.layers) == list(blockwise.sqnr.layers)
    for name, entry in whole.sqnr.layers.items():
        other = blockwise.sqnr.layers[name]
        assert (entry.sqnr_db, entry.shadow_sqnr_db, entry.weight_sqnr_db, entry.batches) == \
            (other.sqnr_db, other.shadow_sqnr_db, other.weight_sqnr_db, other.batches), name
    assert {k: v.sqnr_db for k, v in whole.sqnr.outputs.items()} == \
        {k: v.sqnr_db for k, v in blockwise.sqnr.outputs.items()}
    assert whole.logits == blockwise.logits


def test_a_compressed_tensors_checkpoints_layers_are_the_same_after_its_first_forward(checkpoints):
    """compressed-tensors wraps every module's forward in its offload wrapper at the model's first forward: a
    placement, not a quantization, so the unquantized embedding and head are no layers before it or after it."""
    reference, quantized = _whole(checkpoints / "float"), _whole(checkpoints / "w4a16")
    before = [layer.name for layer in artifact_layers(reference, quantized)]
    with torch.no_grad():
        quantized(**token_batches(1)[0])
    assert "_original_forward_func" in vars(quantized.model.embed_tokens)  # the wrapper this test is about
    after = [layer.name for layer in artifact_layers(reference, quantized)]
    assert after == before
    assert "model.embed_tokens" not in after and "lm_head" not in after and len(after) == 28


def test_block_by_block_equals_the_whole_pass_for_a_compressed_tensors_and_a_torchao_artifact(checkpoints):
    batches = token_batches(3)
    reference = _whole(checkpoints / "float")
    for quantized in (_whole(checkpoints / "w4a16"),
                      torchao_artifact(reference, Int8DynamicActivationInt8WeightConfig())):
        layers = artifact_layers(reference, quantized)
        stack = artifact_stack(reference, quantized)
        assert stack == "model.layers"
        blockwise = measure_artifact_blockwise(reference, quantized, layers, batches, stack, logits=True)
        whole = measure_artifact(reference, quantized, layers, batches, logits=True)
        _same(whole, blockwise)
        swapped = [layers[3].name]   # a fix trial: the reference's layer swapped into one block
        _same(measure_artifact(reference, quantized, layers, batches, float_layers=swapped, logits=True),
              measure_artifact_blockwise(reference, quantized, layers, batches, stack, float_layers=swapped,
                                         logits=True))


def test_an_offloaded_pair_gives_the_rows_of_the_pair_loaded_whole(checkpoints, tmp_path):
    batches = token_batches(3)
    reference, quantized = _whole(checkpoints / "float"), _whole(checkpoints / "w4a16")
    whole = ArtifactAnalysis(reference, quantized, batches, logits=True)
    offloaded_reference = _offloaded(checkpoints / "float", tmp_path / "f")
    offloaded_quantized = _offloaded(checkpoints / "w4a16", tmp_path / "q")
    assert is_offloaded(offloaded_reference) and is_offloaded(offloaded_quantized)
    analysis = ArtifactAnalysis(offloaded_reference, offloaded_quantized, batches, logits=True)
    assert [layer.name for layer in analysis.layers] == [layer.name for layer in whole.layers]   # 28 Linear layers
    assert len(analysis.layers) == 28
    analysis.choose_blocks("auto", None)   # an offloaded model goes block by block
    assert analysis.stack == "model.layers"
    _same(whole.measurement, analysis.measurement)
    # after the pass, nothing stays onloaded or decompressed: the offloaded weights are back on the meta device
    meta = [name for name, p in offloaded_quantized.named_parameters() if p.device.type == "meta"]
    assert meta and all("weight_packed" in n or "weight_scale" in n or "norm" in n or "lm_head" in n
                        or "weight_shape" in n for n in meta)
    compressed = offloaded_quantized.model.layers[3].self_attn.q_proj
    assert compressed.quantization_status.value == "compressed" and "weight" not in dict(
        compressed.named_parameters(recurse=False))
    # the digest, hashed by the pass as it onloaded each block, is the one of the checkpoint loaded whole
    assert analysis.measurement.digest == analysis.digest == state_digest(_whole(checkpoints / "w4a16"))


def test_offloaded_tensors_are_read_one_at_a_time_and_onloaded_once_for_all_batches(checkpoints, tmp_path):
    model = _offloaded(checkpoints / "float", tmp_path / "f")
    whole = _whole(checkpoints / "float")
    name = "model.layers.3.mlp.down_proj.weight"
    assert model.get_submodule("model.layers.3.mlp.down_proj").weight.device.type == "meta"
    assert torch.equal(module_tensor(model, name), whole.get_submodule("model.layers.3.mlp.down_proj").weight)
    block = model.model.layers[3]
    reads = []
    hook = block.mlp.down_proj._hf_hook
    kept = hook.weights_map

    class Counting(dict):
        def __getitem__(self, key):
            reads.append(key)
            return kept[key]

    hook.weights_map = Counting()
    try:
        hidden = torch.randn(2, 16, 64)
        with onloaded(block.mlp), torch.no_grad():
            for _ in range(3):
                block.mlp(hidden)
            assert block.mlp.down_proj.weight.device.type == "cpu"
    finally:
        hook.weights_map = kept
    assert reads.count("weight") == 1   # onloaded once, not once per call
    assert block.mlp.down_proj.weight.device.type == "meta"


def test_a_stack_that_is_not_there_and_an_offload_that_is_gone_are_named(checkpoints, tmp_path):
    reference, quantized = _whole(checkpoints / "float"), _whole(checkpoints / "w4a16")
    with pytest.raises(BlockwiseArtifactError, match="no stack of two or more numbered blocks at 'model.norm'"):
        artifact_stack(reference, quantized, "model.norm")
    folder = tmp_path / "copy"
    shutil.copytree(checkpoints / "float", folder)
    offloaded = _offloaded(folder, tmp_path / "f")
    layers = artifact_layers(offloaded, quantized)
    shutil.rmtree(folder)   # the checkpoint the offload reads from is gone
    with pytest.raises(ArtifactError, match=r"the reference: (block model\.layers\.\d|model\.embed_tokens) could "
                                            r"not be onloaded: .*No such file.*Fix: load the model again"):
        measure_artifact_blockwise(offloaded, quantized, layers, token_batches(1), "model.layers")


def test_a_fix_trial_resumes_from_the_first_block_it_changes_with_the_numbers_of_a_whole_pass(checkpoints):
    batches = token_batches(2)
    reference, quantized = _whole(checkpoints / "float"), _whole(checkpoints / "w4a16")
    layers = artifact_layers(reference, quantized)
    record = StreamRecord()
    measure_artifact_blockwise(reference, quantized, layers, batches, "model.layers", focus=(), logits=True,
                               shadow=False, record=record)
    runs = []
    handles = [block.register_forward_pre_hook(lambda module, args, index=index: runs.append(index))
               for index, block in enumerate(quantized.model.layers)]
    try:
        for swapped, first in (([layers[9].name], 1), ([layers[27].name, layers[20].name], 2), (["lm_head"], 4)):
            if swapped == ["lm_head"]:
                continue   # not a quantized layer of this artifact (compressed-tensors ignores the head)
            start = start_block(swapped, "model.layers", 4, [])
            assert start == first
            runs.clear()
            resumed = resume_artifact_blockwise(reference, quantized, batches, "model.layers", record, start,
                                                float_layers=swapped, logits=True)
            assert sorted(set(runs)) == list(range(first, 4))   # the blocks before it are not run again
            whole = measure_artifact(reference, quantized, layers, batches, float_layers=swapped, focus=(),
                                     logits=True, shadow=False)
            assert {k: v.sqnr_db for k, v in resumed.sqnr.outputs.items()} == \
                {k: v.sqnr_db for k, v in whole.sqnr.outputs.items()}
            assert resumed.logits == whole.logits
    finally:
        for handle in handles:
            handle.remove()
    # the fix search block by block finds and measures what the whole search does
    blockwise = ArtifactAnalysis(reference, quantized, batches, stack="model.layers")
    whole = ArtifactAnalysis(reference, quantized, batches)
    target = whole.sqnr.worst_output().sqnr_db + 3.0
    assert blockwise.float_layers_fix(target, max_batches=1) == whole.float_layers_fix(target, max_batches=1)


class _ScaledBetweenBlocks(torch.nn.Module):
    """A stack whose parent computes between its blocks (halves the stream after each): chaining block outputs
    directly would measure another model."""

    def __init__(self, scale_between=0.5):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(16, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
                                          for _ in range(3))
        self.head = torch.nn.Linear(32, 8)
        self.scale_between = scale_between

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
            if self.scale_between != 1.0:
                x = x * self.scale_between
        return self.head(x)


@pytest.mark.parametrize("scale_between", [0.5, 1.0], ids=["computes_between", "chains"])
def test_a_model_that_computes_between_its_blocks_is_refused_block_by_block_and_named(scale_between):
    reference = _ScaledBetweenBlocks(scale_between).eval()
    quantized = torchao_artifact(reference, Int8DynamicActivationInt8WeightConfig())
    layers = artifact_layers(reference, quantized)
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    if scale_between == 1.0:
        _same(measure_artifact(reference, quantized, layers, batches),
              measure_artifact_blockwise(reference, quantized, layers, batches, "layers"))
        return
    with pytest.raises(BlockwiseArtifactError) as raised:
        measure_artifact_blockwise(reference, quantized, layers, batches, "layers")
    assert "the model computes between the blocks of layers: on batch 0, block layers.1 is not handed what " \
           "layers.0 returns" in str(raised.value) and "Fix: blockwise=False" in str(raised.value)


def test_an_offloaded_moe_pair_measures_every_expert_as_the_pair_loaded_whole(tmp_path):
    """A 2-block Qwen3-MoE and its W4A16 checkpoint written per expert (as llm-compressor saves its linearized
    experts), which transformers loads with the experts fused again and dequantized: offloaded, each expert is a
    layer measured block by block, with the numbers of the pair loaded whole, and each expert's weights compared
    from the offload; after the pass the fused experts wait on the meta device again."""
    from tests.helpers import compressed_tensors_checkpoint
    from tests.models import linearized_moe, tiny_moe

    reference, batches = tiny_moe("qwen3_moe", layers=2, experts=4)
    reference.save_pretrained(tmp_path / "float")
    compressed_tensors_checkpoint(linearized_moe(reference), tmp_path / "w4a16", "W4A16", group_size=32)
    whole = ArtifactAnalysis(_whole(tmp_path / "float"), _whole(tmp_path / "w4a16"), batches, logits=True)
    offloaded_quantized = _offloaded(tmp_path / "w4a16", tmp_path / "q")
    analysis = ArtifactAnalysis(_offloaded(tmp_path / "float", tmp_path / "f"), offloaded_quantized, batches,
                                logits=True)
    analysis.choose_blocks("auto", None)
    assert analysis.stack == "model.layers"
    assert len(analysis.expert_layers) == 2 * 4 * 3   # every expert's gate, up and down projection
    _same(whole.measurement, analysis.measurement)
    assert {path: (block.weight_sqnr_db, block.zeros) for path, block in analysis.checkpoint_experts.items()} == \
        {path: (block.weight_sqnr_db, block.zeros) for path, block in whole.checkpoint_experts.items()}
    assert len(analysis.checkpoint_experts) == 2
    experts = offloaded_quantized.model.layers[1].mlp.experts
    assert experts.gate_up_proj.device.type == "meta" and experts.down_proj.device.type == "meta"
    # the artifact's identity is its state as loaded, whole or offloaded (a whole pass decompresses it in place)
    assert analysis.measurement.digest == analysis.digest == whole.digest == state_digest(_whole(tmp_path / "w4a16"))


def test_an_offloaded_pair_without_a_stack_is_measured_in_whole_passes_with_its_weights_read_from_the_offload(
        tmp_path):
    """A one-block MoE pair offloaded to disk whole (one hook at the root): no stack to go block by block, so whole
    passes onload through the hooks, and each layer's weights (each expert's) are read from the offload after the
    pass, with the numbers of the pair loaded whole."""
    from tests.helpers import float_and_w4a16_moe_checkpoints
    from tests.models import tiny_moe

    float_and_w4a16_moe_checkpoints(tmp_path, layers=1)
    batches = tiny_moe("qwen3_moe", layers=1, experts=4)[1]
    whole = ArtifactAnalysis(_whole(tmp_path / "float"), _whole(tmp_path / "w4a16"), batches, logits=True)
    analysis = ArtifactAnalysis(_offloaded(tmp_path / "float", tmp_path / "f"),
                                _offloaded(tmp_path / "w4a16", tmp_path / "q"), batches, logits=True)
    analysis.choose_blocks("auto", None)
    assert analysis.stack is None and analysis.offloaded
    assert len(analysis.expert_layers) == 4 * 3
    for name, entry in whole.sqnr.layers.items():
        other = analysis.sqnr.layers[name]
        assert other.weight_sqnr_db == pytest.approx(entry.weight_sqnr_db, abs=1e-6), name
        assert other.sqnr_db == pytest.approx(entry.sqnr_db, abs=1e-4), name
