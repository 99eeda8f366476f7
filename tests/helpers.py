"""What several test modules share: the models their pytester projects declare, the readers of a run's output,
and torchao's reference numerics of each preset."""
import math
import re

import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.quantization.quant_primitives import (
    MappingType,
    _choose_scale_float8,
    _dequantize_affine_float8,
    _quantize_affine_float8,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)

from pytest_qreport.checks import BUILTIN_CHECKS
from pytest_qreport.core.pipeline import collect_model
from pytest_qreport.core.quantizers import model_quantizer, pytest_qreport_make_quantizer
from pytest_qreport.core.registry import CheckRegistry
from pytest_qreport.core.settings import ModelSettings

# the two-layer model most plugin tests declare; other test modules reuse it
TINY_SOURCE = '''
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
'''


# a residual stack of blocks with a stem and a head (Block, Stack), for block-wise runs; uses torch and nn
STACK_SOURCE = '''
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 64)
        self.layers = nn.ModuleList([Block(64) for _ in range(4)])  # 66 KiB each
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
'''


# four linears, the third with four input columns 25x the rest: NVFP4 loses them, a finer format keeps them (the
# source of a class Net, for pytester projects and for the tests that exec it)
LADDER_NET = '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(128, 128) for _ in range(4)])
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(128, 128, generator=g) / 128 ** 0.5)
            self.layers[2].weight[:, :4] *= 25.0

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = layer(x) if index == 3 else torch.relu(layer(x))
        return x
'''


def run_with_rows(pytester, *args):
    """(the result of `pytest --qreport -v` with `args`, its JSON rows by (model, check, layer))."""
    import json

    result = pytester.runpytest("--qreport", "-v", "--qreport-json=report.json", *args)
    rows = json.loads((pytester.path / "report.json").read_text())["rows"]
    return result, {(r["model"], r["check"], r["layer"]): r for r in rows}


def run_examples(pytester, monkeypatch, *args, failing=False, cache_dir=None):
    """`pytest --qreport -q -p no:xdist *args examples/` at the repository's root, in a forked child of this process
    (tests/forked.py): the example repository's failing models declared too with `failing`, its layer lists cached
    in `cache_dir` (None: no cache)."""
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    if failing:
        monkeypatch.setenv("QREPORT_EXAMPLES_FAILING", "1")
    cache = ["-o", f"cache_dir={cache_dir}"] if cache_dir is not None else ["-p", "no:cacheprovider"]
    return pytester.runpytest("--qreport", "-q", "-p", "no:xdist", *cache, *args, "examples/")


def outcomes(result):
    """{node id: outcome} from -v output, serial ("id OUTCOME") or xdist ("OUTCOME id")."""
    text = result.stdout.str()
    found = dict(re.findall(r"(conftest\.py::qreport/\S+) (PASSED|FAILED|ERROR)", text))
    found.update({node: outcome for outcome, node in
                  re.findall(r"(PASSED|FAILED|ERROR) (conftest\.py::qreport/\S+)", text)})
    return found


def summary_section(result):
    """The summary section, less its timing line (times differ from run to run)."""
    text = result.stdout.str()
    start = text.index("qreport summary")
    lines = text[start:text.index("\n=", start)].splitlines()
    return "\n".join(line for line in lines if not line.startswith("analysis time: "))


FRAGILE_SOURCE = '''
import torch
from torch import nn
from pytest_qreport import qmodel


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                    nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        with torch.no_grad():   # four loud hidden units, scaled back by the next layer: float-equivalent
            self.layers[2].weight[:4] *= 60.0
            self.layers[4].weight[:, :4] /= 60.0

    def forward(self, x):
        return self.layers(x)


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 64, generator=g) for _ in range(4)]
'''


BUDGET_CONFTEST = """
import pytest
import torch
from torch import nn
from pytest_qreport import qmodel


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 256, generator=g) for _ in range(2)]


@qmodel(calibration="batches", checks=["sqnr"])
def wide():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).eval()  # 514 KiB of weights


@qmodel(calibration="batches", checks=["sqnr"])
def narrow():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 4)).eval()  # 8.2 KiB
"""


PLUGIN_CONFTEST = TINY_SOURCE + '''

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(4)]


@pytest.fixture
def wrong_batches():
    return [torch.randn(16, 8), torch.randn(16, 5)]


@qmodel(calibration="batches", {options})
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()
{extra}
'''

SQNR_ONLY = "qreport_checks = sqnr,weight_sqnr,model_sqnr\n"

BUDGET_EVENTS = """

import os
import time


def log(event):
    with open(os.path.join(os.path.dirname(__file__), "events.txt"), "a") as events:
        events.write(event + "\\n")


def pytest_qreport_modify_findings(model, findings):
    log(f"analysed {model}")
    return None
"""


class PluginHook:
    def pytest_qreport_make_quantizer(self, name):
        return pytest_qreport_make_quantizer(name)


def builtin_registry():
    """A CheckRegistry holding the built-in checks, as a session's has them."""
    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    return registry


def tiny_sequential():
    """A seeded 8 -> 16 -> 4 MLP as nn.Sequential, in eval mode."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def count_aten_ops(function):
    """(the aten ops `function()` dispatches, what it returned)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.total += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        returned = function()
    return Counter.total, returned


def count_op_calls(function, op):
    """(how many times `function()` dispatches the aten op `op` (an overload packet: torch.ops.aten.addmm), what it
    returned)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.calls += func.overloadpacket is op
            return func(*args, **(kwargs or {}))

    with Counter():
        returned = function()
    return Counter.calls, returned


def padded_token_batches(count, rows, tokens, padded_from, vocabulary, seed):
    """`count` batches of {"input_ids": seeded random ids [rows, tokens], "attention_mask": ones, zero from
    `padded_from` on}, as a tokenizer pads sentences."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        mask = torch.ones(rows, tokens, dtype=torch.long)
        mask[:, padded_from:] = 0
        batches.append({"input_ids": torch.randint(0, vocabulary, (rows, tokens), generator=generator),
                        "attention_mask": mask})
    return batches


def analyze_with_checks(factory, batches, **settings):
    """{(check, layer): Finding} of a model, as the plugin computes them, and the model's qcore analysis."""
    registry = builtin_registry()
    resolved = ModelSettings.defaults(BUILTIN_CHECKS, calibration=batches, **settings)
    pipeline = collect_model("m", resolved, registry, model_quantizer(resolved, PluginHook()), factory(), batches[0])
    pipeline.analyze(lambda: batches, lambda found: None)
    assert pipeline.findings is not None, pipeline.error
    return pipeline.findings, pipeline.context.analysis


def layer_computations(analysis):
    """{layer: what it computes with} of an analysis's quantized model: for each op of a layer, the op, its weights
    (as quantized, or float where the layer is kept in float) and the quantization of every activation it reads.
    A tensor between two layers belongs to its reader; a model output, to the layer that makes it."""
    from torch.fx.graph_module import _get_attr

    gm = analysis.quantized_gm
    found = {}

    def described(node):
        if node.op == "get_attr":
            return ("tensor", _get_attr(gm, node.target))
        if node.meta.get("qcore_inserted"):  # a fake-quantize: its function and its qparams
            return ("quantized", getattr(node.target, "__name__", str(node.target)),
                    tuple(arg for arg in node.args[1:] if not isinstance(arg, torch.fx.Node)))
        return ("float",)

    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op == "call_function" and stack:
            layer = next(reversed(stack.values()))[0]
            found.setdefault(layer, []).append((str(node.target), *map(described, node.all_input_nodes)))
        elif node.op == "output":
            for value in node.all_input_nodes:
                maker = value.args[0] if value.meta.get("qcore_inserted") else value
                stack = getattr(maker, "meta", {}).get("nn_module_stack")
                layer = next(reversed(stack.values()))[0] if stack else "(input)"
                found.setdefault(layer, []).append(("output", described(value)))
    return found


def _same_computation(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float):  # an exact rewrite upstream moves a range in its last bits
        return math.isclose(a, b, rel_tol=1e-5)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_computation(x, y) for x, y in zip(a, b))
    return a == b


def changed_layers(before, after):
    """The layers whose computation differs between `before` and `after` (two analyses of one model): those
    `before` quantizes, and any other that `after` quantizes."""
    a, b = layer_computations(before), layer_computations(after)
    names = {entry.layer for entry in before.layers} | {entry.layer for entry in after.layers}
    return {layer for layer in names if not _same_computation(a.get(layer), b.get(layer))}


# ---- torchao 0.18's reference numerics of each preset (tests/conftest.py imports torchao already)

E4M3 = torch.float8_e4m3fn


def _integer(x, block, bits, symmetric=True):
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    mapping = MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC
    scale, zero_point = choose_qparams_affine(x, mapping, block, torch.int8, qmin, qmax)
    return dequantize_affine(quantize_affine(x, block, scale, zero_point, torch.int8, qmin, qmax), block, scale,
                             zero_point, torch.int8, qmin, qmax)


def _float8(x, block=None, scale=None):
    scale = _choose_scale_float8(x, list(block), E4M3) if scale is None else scale
    return _dequantize_affine_float8(_quantize_affine_float8(x, scale, E4M3), scale)


def _mx(x, elements):
    scale, data = to_mx(x.contiguous(), elements, 32, ScaleCalculationMode.FLOOR)
    return to_dtype(data, scale, elements, 32, torch.float32)


def _nvfp4(x, amax):
    rows = x.reshape(-1, x.shape[-1])
    global_scale = per_tensor_amax_to_scale(amax)
    scales, packed = nvfp4_quantize(rows, 16, global_scale)
    values = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(rows.shape[0], -1, 16)
    return (values * (global_scale * scales.to(torch.float32)).unsqueeze(-1)).reshape(x.shape)


CALIBRATION_AMAX = torch.tensor(97.0)  # a static activation scale's calibration amax


WEIGHT_REFERENCES = {
    "W8A8": lambda w: _integer(w, (1, w.shape[1]), 8),
    "W8A16": lambda w: _integer(w, (1, w.shape[1]), 8),
    "W4A16": lambda w: _integer(w, (1, 128), 4),
    "W4A16_ASYM": lambda w: _integer(w, (1, 128), 4, symmetric=False),
    "FP8": lambda w: _float8(w, w.shape),
    "FP8_DYNAMIC": lambda w: _float8(w, (1, w.shape[1])),
    "FP8_BLOCK": lambda w: _float8(w, (128, 128)),
    "MXFP8": lambda w: _mx(w, E4M3),
    "MXFP4": lambda w: _mx(w, torch.float4_e2m1fn_x2),
    "NVFP4": lambda w: _nvfp4(w, w.abs().amax()),
    "NVFP4A16": lambda w: _nvfp4(w, w.abs().amax()),
}


ACTIVATION_REFERENCES = {
    "W8A8": lambda x: _integer(x, (1, 1, x.shape[-1]), 8),
    "FP8": lambda x: _float8(x, scale=(CALIBRATION_AMAX / 448.0).reshape(1, 1, 1)),
    "FP8_DYNAMIC": lambda x: _float8(x, (1, 1, x.shape[-1])),
    "FP8_BLOCK": lambda x: _float8(x, (1, 1, 128)),
    "MXFP8": lambda x: _mx(x, E4M3),
    "MXFP4": lambda x: _mx(x, torch.float4_e2m1fn_x2),
    "NVFP4": lambda x: _nvfp4(x, CALIBRATION_AMAX),
}




# -- artifacts: quantized models as the tools users ship them make them -----------------------------------------------
def tiny_llama(seed=0, layers=2):
    """A tiny Llama with seeded weights, default config otherwise (the float reference of the artifact tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def token_batches(count=4, seed=1):
    """Causal-LM batches for tiny_llama: input_ids only."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 128, (2, 16), generator=generator)} for _ in range(count)]


def torchao_artifact(reference, config):
    """`reference` copied and quantized in place by torchao's quantize_ with `config`."""
    import copy

    from torchao.quantization import quantize_

    model = copy.deepcopy(reference)
    quantize_(model, config)
    return model


def compressed_tensors_checkpoint(reference, directory, preset="W8A8", group_size=None, damaged=None):
    """`reference` quantized with compressed-tensors' preset scheme (round-to-nearest scales from its own
    calculate_qparams; NVFP4's global scales from the weights and from the layer inputs of one calibration batch;
    `damaged`: a layer whose weight scale is multiplied by 3), saved in its compressed format to `directory` and
    loaded back with transformers' from_pretrained, as a checkpoint from llm-compressor is (NVFP4 in bfloat16, the
    dtype its weights decompress to)."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    input_ranges = _linear_input_ranges(reference) if preset == "NVFP4" else {}
    model = copy.deepcopy(reference)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size:
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for name, module in model.named_modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        weight = module.weight.detach()
        global_scale = None
        if hasattr(module, "weight_global_scale"):  # NVFP4: a per-tensor scale over the groups' FP8 scales
            global_scale = generate_gparam(weight.amin().reshape(1), weight.amax().reshape(1))
            module.weight_global_scale.data.copy_(global_scale.reshape(module.weight_global_scale.shape))
        if hasattr(module, "input_global_scale"):
            low, high = input_ranges[name]
            module.input_global_scale.data.copy_(generate_gparam(low, high).reshape(module.input_global_scale.shape))
        if args.strategy in ("group", "tensor_group"):
            weight = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = weight.amin(-1), weight.amax(-1)
        elif args.strategy == "channel":
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        else:
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        scale, zero_point = calculate_qparams(low, high, args, global_scale=global_scale)
        module.weight_scale.data.copy_((scale * 3 if name == damaged else scale).reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    fmt = {"W4A16": "pack-quantized", "FP8_DYNAMIC": "float-quantized", "NVFP4": "nvfp4-pack-quantized"}.get(
        preset, "int-quantized")
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    dtype = torch.bfloat16 if preset == "NVFP4" else None
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def float_and_w4a16_checkpoints(folder, layers=4):
    """`folder` with a tiny Llama of `layers` blocks saved in float (`float/`) and its W4A16 compressed-tensors
    checkpoint (`w4a16/`, groups of 32), as llm-compressor saves one: the pair the offload tests load."""
    reference = tiny_llama(layers=layers)
    reference.save_pretrained(folder / "float")
    compressed_tensors_checkpoint(reference, folder / "w4a16", "W4A16", group_size=32)
    return folder


def float_and_w4a16_moe_checkpoints(folder, layers=2, experts=4):
    """`folder` with a tiny Qwen3-MoE of `layers` blocks saved in float (`float/`) and its W4A16 compressed-tensors
    checkpoint (`w4a16/`, groups of 32) written expert by expert, as llm-compressor saves its linearized experts
    (transformers loads it with the experts fused again and dequantized)."""
    from tests.models import linearized_moe, tiny_moe

    reference = tiny_moe("qwen3_moe", layers=layers, experts=experts)[0]
    reference.save_pretrained(folder / "float")
    compressed_tensors_checkpoint(linearized_moe(reference), folder / "w4a16", "W4A16", group_size=32)
    return folder


def _linear_input_ranges(model):
    """{Linear's name: (min, max) of its input} over one calibration batch of token_batches."""
    ranges, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(module, args, name=name):
                ranges[name] = (args[0].detach().amin().reshape(1), args[0].detach().amax().reshape(1))
            handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(**token_batches(1)[0])
    for handle in handles:
        handle.remove()
    return ranges


def direct_layer_sqnr(reference, quantized, names, batches):
    """{layer: SQNR in dB} of each layer's output, quantized model against reference, computed with forward hooks on
    both models over `batches` (float64 sums), and the mean KL(reference || quantized) of the logits' softmax."""
    outputs = {"reference": {}, "quantized": {}}
    sums = {name: [0.0, 0.0] for name in names}
    kl, positions = 0.0, 0

    def keep(side, name):
        def hook(module, args, output):
            outputs[side][name] = output.detach().double()
        return hook

    handles = [model.get_submodule(name).register_forward_hook(keep(side, name))
               for side, model in (("reference", reference), ("quantized", quantized)) for name in names]
    try:
        with torch.no_grad():
            for batch in batches:
                expected = reference(**batch, use_cache=False).logits.double()
                actual = quantized(**batch, use_cache=False).logits.double()
                for name in names:
                    ref, ours = outputs["reference"][name], outputs["quantized"][name]
                    sums[name][0] += float((ref * ref).sum())
                    sums[name][1] += float(((ours - ref) ** 2).sum())
                log_p = torch.log_softmax(expected.reshape(-1, expected.shape[-1]), -1)
                log_q = torch.log_softmax(actual.reshape(-1, actual.shape[-1]), -1)
                kl += float((log_p.exp() * (log_p - log_q)).sum())
                positions += log_p.shape[0]
    finally:
        for handle in handles:
            handle.remove()
    import math

    return {name: 10 * math.log10(signal / noise) for name, (signal, noise) in sums.items()}, kl / positions


FRAGILE_LAYER = "model.layers.1.mlp.down_proj"
TINY_LLAMA_LINEARS = [f"model.layers.{i}.{part}" for i in range(2) for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj")]


def fragile_llama(seed=0):
    """tiny_llama with one fragile layer, FRAGILE_LAYER: one weight of each row 60 times the others, so that any
    per-row or per-block scale spends its range on it and the rest of the row is quantized coarsely."""
    model = tiny_llama(seed)
    weight = model.get_submodule(FRAGILE_LAYER).weight
    with torch.no_grad():
        columns = torch.arange(weight.shape[0]) * 7 % weight.shape[1]
        weight[torch.arange(weight.shape[0]), columns] *= 60
    return model


def saved_llama(model, folder):
    """`model` saved with a tiny word-level tokenizer (tools that load a checkpoint by path want one): `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(model.config.vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1", bos_token="t2",
                            eos_token="t3").save_pretrained(folder)
    return folder


def weight_sqnr_db(reference_weight, weight):
    """10 log10 of the reference weight's energy over the error's, in float64."""
    import math

    theirs = reference_weight.detach().double()
    ours = weight.detach().double().reshape(theirs.shape)
    return 10 * math.log10(float((theirs**2).sum()) / float(((ours - theirs) ** 2).sum()))


def output_sqnr_db(reference, quantized, batches):
    """The logits' SQNR over `batches`, quantized model against reference (float64 sums)."""
    import math

    signal = noise = 0.0
    with torch.no_grad():
        for batch in batches:
            expected = reference(**batch, use_cache=False).logits.double()
            actual = quantized(**batch, use_cache=False).logits.double()
            signal += float((expected**2).sum())
            noise += float(((actual - expected) ** 2).sum())
    return 10 * math.log10(signal / noise)


def hqq_artifact(reference, bits=4, group_size=64):
    """`reference` copied and quantized by HQQ's own AutoHQQHFModel.quantize_model (float32 compute, on the CPU)."""
    import copy

    from hqq.core.quantize import BaseQuantizeConfig
    from hqq.models.hf.base import AutoHQQHFModel

    model = copy.deepcopy(reference)
    AutoHQQHFModel.quantize_model(model, quant_config=BaseQuantizeConfig(nbits=bits, group_size=group_size),
                                  compute_dtype=torch.float32, device="cpu")
    return model.eval()


def gptq_artifact(reference, folder, config="bits=4, group_size=32", batches=None):
    """`reference` quantized by GPTQModel as its users do: GPTQModel.load with QuantizeConfig(<config>) (keyword
    arguments as written in Python), quantize on `batches` (default token_batches(8)) one sequence at a time, save
    under `folder`, and GPTQModel.load of the saved checkpoint on the CPU (its wrapper, as returned)."""
    import contextlib
    import os

    from gptqmodel import GPTQModel, QuantizeConfig

    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))
    source = saved_llama(reference, folder / "float")
    quantize_config = eval(f"QuantizeConfig({config})", {"QuantizeConfig": QuantizeConfig})
    calibration = [{"input_ids": ids.unsqueeze(0), "attention_mask": torch.ones_like(ids).unsqueeze(0)}
                   for batch in (batches or token_batches(8)) for ids in batch["input_ids"]]
    with contextlib.chdir(folder):  # its quantization log goes to ./logs
        model = GPTQModel.load(str(source), quantize_config, device="cpu")
        model.quantize(calibration, batch_size=1)
        model.save(str(folder / "gptq"))
    return GPTQModel.load(str(folder / "gptq"), device="cpu")
