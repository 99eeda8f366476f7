"""Small models for the tests."""
import torch
from torch import nn


class SmallMLP(nn.Module):
    def __init__(self, features=32, hidden=64, classes=8):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.relu2(self.conv2(self.relu1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class CatModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x)], dim=1))


class KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids) * attention_mask[..., None]
        return self.proj(x)


class DataDependent(nn.Module):
    """Python control flow on a tensor value: neither export nor symbolic_trace can capture it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def batches(shape, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def tiny_llama(layers=2, batch=4):
    """A transformers Llama (hidden 64, 256-token vocabulary, seeded) and 3 batches of 16 tokens whose last 4
    positions are masked out."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        mask = torch.ones(batch, 16, dtype=torch.long)
        mask[:, 12:] = 0
        batches.append({"input_ids": torch.randint(0, 256, (batch, 16), generator=g), "attention_mask": mask})
    return model, batches


# gpt-oss: transposed, interleaved gate/up with biases and its own gate; Qwen2-MoE: a shared expert beside them;
# DeepSeek-V3: a shared expert, and a router that chooses by groups with a score correction bias
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3")


def logits_of(output):
    """The logits of a causal LM's output: a captured graph's dict, a transformers output, or a tuple's first."""
    if isinstance(output, dict):
        return output["logits"]
    return output.logits if hasattr(output, "logits") else output[0]


def tiny_moe(architecture="qwen3_moe", layers=1, experts=4, hidden=128, batch=2, tokens=16, n=3, positions=64,
             width=128):
    """A transformers mixture-of-experts causal LM whose experts are fused 3-D parameters (transformers 5), with seeded
    weights of trained-model scale (std 0.05: the routers' choices are not ties), and `n` batches of token ids.
    `width`: a Qwen3-MoE expert's intermediate size."""
    import transformers

    common = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=positions, use_cache=False)
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=width,
                                                         num_experts=experts, num_experts_per_tok=2),
        "mixtral": lambda: transformers.MixtralConfig(**common, intermediate_size=128, num_local_experts=experts,
                                                      num_experts_per_tok=2),
        "gpt_oss": lambda: transformers.GptOssConfig(**common, intermediate_size=128, num_local_experts=experts,
                                                     num_experts_per_tok=2, layer_types=["full_attention"] * layers),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                                                         intermediate_size=256, moe_intermediate_size=128,
                                                         shared_expert_intermediate_size=128, num_experts=experts,
                                                         num_experts_per_tok=2),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(  # multi-head latent attention: as many kv heads
            **{k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}, num_key_value_heads=4,
            intermediate_size=256, moe_intermediate_size=128,
            n_routed_experts=experts, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
            kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32),
        "olmoe": lambda: transformers.OlmoeConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                                                  intermediate_size=128, num_experts=experts, num_experts_per_tok=2),
    }
    config = configs[architecture]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.05)
    g = torch.Generator().manual_seed(0)
    return model, [{"input_ids": torch.randint(0, 128, (batch, tokens), generator=g)} for _ in range(n)]


class _ExpertMLP(nn.Module):
    """One expert as its own gate, up and down Linear layers."""

    def __init__(self, gate, up, down, act_fn):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear_of(weight) for weight in (gate, up, down))
        self.act_fn = act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _linear_of(weight):
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


class LinearizedExperts(nn.ModuleList):
    """A block's fused experts (concatenated gate and up, not transposed, no bias) as one module per expert, each
    computing on the tokens routed to it, as llm-compressor's linearized experts do (its LinearExperts2D)."""

    def __init__(self, fused):
        half = fused.gate_up_proj.shape[1] // 2
        weights = fused.gate_up_proj.detach()
        super().__init__([_ExpertMLP(weights[e, :half], weights[e, half:], fused.down_proj[e].detach(), fused.act_fn)
                          for e in range(fused.gate_up_proj.shape[0])])
        self.num_experts = len(self)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        output = torch.zeros_like(hidden_states)
        chosen = torch.nn.functional.one_hot(top_k_index, self.num_experts).permute(2, 1, 0)
        for expert in range(self.num_experts):
            position, tokens = torch.where(chosen[expert])
            routed = self[expert](hidden_states[tokens]) * top_k_weights[tokens, position, None]
            output.index_add_(0, tokens, routed.to(output.dtype))
        return output


def linearized_moe(model):
    """A copy of a tiny_moe model whose every block holds its experts as modules (LinearizedExperts)."""
    import copy

    from qcore.graph.experts import fused_experts_modules

    linearized = copy.deepcopy(model)
    for path in fused_experts_modules(linearized):
        parent, _, name = path.rpartition(".")
        linearized.get_submodule(parent).set_submodule(name, LinearizedExperts(linearized.get_submodule(path)))
    return linearized


def layer_calls(model, names, batches):
    """{name: ([its input on each call], [its output on each call])} of the named layers of `model` over `batches`
    (forward hooks; the model called with each batch's keyword arguments)."""
    calls = {name: ([], []) for name in names}

    def keep(name):
        def hook(module, args, output):
            calls[name][0].append(args[0])
            calls[name][1].append(output)
        return hook

    handles = [model.get_submodule(name).register_forward_hook(keep(name)) for name in names]
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def routed_tokens(model, batches, layer=0):
    """{expert: [the hidden states each batch routes to it]} of the eager model's MoE block `layer` (transformers'
    own experts implementation, read at the experts module's inputs)."""
    experts = model.model.layers[layer].mlp.experts
    routed = {expert: [] for expert in range(experts.num_experts)}

    def keep(module, args):
        hidden, index, _ = args
        for expert in routed:
            routed[expert].append(hidden[(index == expert).any(-1)])

    handle = experts.register_forward_pre_hook(keep)
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    return routed
