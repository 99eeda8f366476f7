"""Transformers architectures as users declare them: the model class on its config class with default settings
(use_cache, attention implementation, tied embeddings), only the sizes made tiny, and seeded random weights.

`ARCHITECTURES` maps a name to (family, build), where build() returns (model, calibration batches). The zoo
(`benchmarks/bench_hf_zoo.py`) runs all of them; the test suite runs a few (`SMOKE`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VOCAB, SEQ, BATCH, BATCHES = 128, 16, 2, 3
# widths of 128 and 256: every linear of a decoder or encoder fits the formats' blocks (W4A16's groups of 128)
DECODER = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
ENCODER = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)
SMOKE = ("gpt2", "llama", "t5", "wav2vec2", "convnext")


def _transformers():
    import transformers

    return transformers


def _tokens(seed: int = 0, mask: bool = True, vocab: int = VOCAB) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(BATCHES):
        batch = {"input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=g)}
        if mask:
            batch["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        batches.append(batch)
    return batches


def _seq2seq(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(2, VOCAB, (BATCH, SEQ), generator=g),
             "decoder_input_ids": torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g)} for _ in range(BATCHES)]


def _images(size: int = 32, channels: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"pixel_values": torch.randn(BATCH, channels, size, size, generator=g)} for _ in range(BATCHES)]


def _audio(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_values": torch.randn(BATCH, 1600, generator=g)} for _ in range(BATCHES)]


def _built(model_class: str, config_class: str, batches: list, **config: Any) -> tuple[torch.nn.Module, list]:
    t = _transformers()
    torch.manual_seed(0)
    model = getattr(t, model_class)(getattr(t, config_class)(**config)).eval()
    return model, batches


def _decoder(model_class: str, config_class: str, **extra: Any) -> Callable[[], tuple[torch.nn.Module, list]]:
    return lambda: _built(model_class, config_class, _tokens(), **{**DECODER, **extra})


def _encoder(model_class: str, config_class: str, **extra: Any) -> Callable[[], tuple[torch.nn.Module, list]]:
    return lambda: _built(model_class, config_class, _tokens(), **{**ENCODER, **extra})


GPT2 = dict(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=64)
ARCHITECTURES: dict[str, tuple[str, Callable[[], tuple[torch.nn.Module, list]]]] = {
    # decoders
    "gpt2": ("decoder", lambda: _built("GPT2LMHeadModel", "GPT2Config", _tokens(), **GPT2)),
    "gpt_neox": ("decoder", _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", num_key_value_heads=None)),
    "opt": ("decoder", lambda: _built("OPTForCausalLM", "OPTConfig", _tokens(), vocab_size=VOCAB, hidden_size=128,
                                      ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=64, word_embed_proj_dim=128)),
    "llama": ("decoder", _decoder("LlamaForCausalLM", "LlamaConfig")),
    "mistral": ("decoder", _decoder("MistralForCausalLM", "MistralConfig")),
    "qwen2": ("decoder", _decoder("Qwen2ForCausalLM", "Qwen2Config")),
    "qwen3": ("decoder", _decoder("Qwen3ForCausalLM", "Qwen3Config", head_dim=32)),
    "phi3": ("decoder", _decoder("Phi3ForCausalLM", "Phi3Config", pad_token_id=0)),
    "gemma2": ("decoder", _decoder("Gemma2ForCausalLM", "Gemma2Config", head_dim=32)),
    "gemma3": ("decoder", _decoder("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=32)),
    "falcon": ("decoder", lambda: _built("FalconForCausalLM", "FalconConfig", _tokens(), vocab_size=VOCAB,
                                         hidden_size=128, num_hidden_layers=2, num_attention_heads=4)),
    "granite": ("decoder", _decoder("GraniteForCausalLM", "GraniteConfig")),
    "olmo": ("decoder", _decoder("OlmoForCausalLM", "OlmoConfig")),
    "bloom": ("decoder", lambda: _built("BloomForCausalLM", "BloomConfig", _tokens(), vocab_size=VOCAB,
                                        hidden_size=128, n_layer=2, n_head=4)),
    # mixture of experts
    "mixtral": ("moe", _decoder("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("moe", _decoder("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=32, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=128)),
    "qwen2_moe": ("moe", _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=128, shared_expert_intermediate_size=128)),
    "olmoe": ("moe", _decoder("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("moe", _decoder("GptOssForCausalLM", "GptOssConfig", head_dim=32, num_local_experts=4,
                                num_experts_per_tok=2, layer_types=["full_attention"] * 2)),
    "deepseek_v3": ("moe", _decoder("DeepseekV3ForCausalLM", "DeepseekV3Config", num_key_value_heads=4,
                                    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                    first_k_dense_replace=0, moe_intermediate_size=128, kv_lora_rank=32,
                                    q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)),
    "deepseek_v2": ("moe", _decoder("DeepseekV2ForCausalLM", "DeepseekV2Config", num_key_value_heads=4,
                                    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                    first_k_dense_replace=0, moe_intermediate_size=128, kv_lora_rank=32,
                                    q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)),
    "phimoe": ("moe", _decoder("PhimoeForCausalLM", "PhimoeConfig", num_local_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("moe", _decoder("GraniteMoeForCausalLM", "GraniteMoeConfig", num_local_experts=4,
                                   num_experts_per_tok=2)),
    "granitemoeshared": ("moe", _decoder("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig",
                                         num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128)),
    "glm4_moe": ("moe", _decoder("Glm4MoeForCausalLM", "Glm4MoeConfig", head_dim=32, n_routed_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=0,
                                 n_group=1, topk_group=1)),
    "ernie4_5_moe": ("moe", _decoder("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", head_dim=32, moe_num_experts=4,
                                     moe_k=2, moe_intermediate_size=128, moe_layer_start_index=0)),
    "hunyuan_v1_moe": ("moe", _decoder("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", head_dim=32, num_experts=4,
                                       moe_topk=2)),
    "dots1": ("moe", _decoder("Dots1ForCausalLM", "Dots1Config", head_dim=32, n_shared_experts=1, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=0, n_group=1,
                              topk_group=1)),
    "minimax": ("moe", _decoder("MiniMaxForCausalLM", "MiniMaxConfig", head_dim=32, num_local_experts=4,
                                num_experts_per_tok=2, layer_types=["full_attention"] * 2)),
    "flex_olmo": ("moe", _decoder("FlexOlmoForCausalLM", "FlexOlmoConfig", pad_token_id=0, num_experts=4,
                                  num_experts_per_tok=2)),
    "exaone_moe": ("moe", _decoder("ExaoneMoeForCausalLM", "ExaoneMoeConfig", head_dim=32, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=128)),
    "lfm2_moe": ("moe", _decoder("Lfm2MoeForCausalLM", "Lfm2MoeConfig", num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=128, num_dense_layers=0, layer_types=["full_attention"] * 2)),
    # encoders
    "bert": ("encoder", _encoder("BertForSequenceClassification", "BertConfig")),
    "roberta": ("encoder", _encoder("RobertaForMaskedLM", "RobertaConfig", pad_token_id=1)),
    "distilbert": ("encoder", lambda: _built("DistilBertForSequenceClassification", "DistilBertConfig", _tokens(),
                                             vocab_size=VOCAB, dim=128, hidden_dim=256, n_layers=2, n_heads=4,
                                             max_position_embeddings=64)),
    "albert": ("encoder", _encoder("AlbertModel", "AlbertConfig", embedding_size=128)),
    "electra": ("encoder", _encoder("ElectraForSequenceClassification", "ElectraConfig", embedding_size=128)),
    "deberta_v2": ("encoder", _encoder("DebertaV2Model", "DebertaV2Config")),
    # sequence to sequence
    "t5": ("seq2seq", lambda: _built("T5ForConditionalGeneration", "T5Config", _seq2seq(), vocab_size=VOCAB,
                                     d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                                     decoder_start_token_id=0)),
    "bart": ("seq2seq", lambda: _built("BartForConditionalGeneration", "BartConfig", _seq2seq(), vocab_size=VOCAB,
                                       d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                                       max_position_embeddings=64)),
    # vision
    "vit": ("vision", lambda: _built("ViTForImageClassification", "ViTConfig", _images(), hidden_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, image_size=32,
                                     patch_size=8)),
    "convnext": ("vision", lambda: _built("ConvNextForImageClassification", "ConvNextConfig", _images(),
                                          hidden_sizes=[16, 32, 64, 256], depths=[1, 1, 1, 1])),
    "resnet": ("vision", lambda: _built("ResNetForImageClassification", "ResNetConfig", _images(),
                                        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])),
    "swin": ("vision", lambda: _built("SwinForImageClassification", "SwinConfig", _images(), image_size=32,
                                      patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4)),
    # audio
    "wav2vec2": ("audio", lambda: _built("Wav2Vec2ForCTC", "Wav2Vec2Config", _audio(), vocab_size=32, hidden_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                         conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
                                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)),
    "whisper": ("audio", lambda: _built("WhisperForConditionalGeneration", "WhisperConfig", _whisper(),
                                        vocab_size=VOCAB, d_model=128, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                                        decoder_ffn_dim=256, num_mel_bins=128, max_source_positions=32,
                                        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2)),
}


def _whisper(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_features": torch.randn(BATCH, 128, 64, generator=g),
             "decoder_input_ids": torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)} for _ in range(BATCHES)]
