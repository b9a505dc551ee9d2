"""Tiny randomly initialised models built from the real transformers config classes."""
from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Ministral3Config, Ministral3ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

VOCAB = 96


def _common(layers, hidden, heads, kv_heads, head_dim):
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, max_position_embeddings=131072, attn_implementation="eager")


def qwen3_config(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, **kw):
    """Qwen3 (k_norm before RoPE, default RoPE)."""
    return Qwen3Config(**(_common(layers, hidden, heads, kv_heads, head_dim) | kw), tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def llama3_config(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, **kw):
    """Llama 3.1 style: llama3 RoPE scaling."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(**(_common(layers, hidden, heads, kv_heads, head_dim) | kw), rope_parameters=rope)


def ministral3_config(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, **kw):
    """Ministral 3 text stack: YaRN with attention_factor != 1 (attention_scaling = 1.25)."""
    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
            "attention_factor": 1.25, "llama_4_scaling_beta": 0.1}
    common = _common(layers, hidden, heads, kv_heads, head_dim) | {"max_position_embeddings": 262144} | kw
    return Ministral3Config(**common, rope_parameters=rope, tie_word_embeddings=False)


_CLASSES = {"qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM, "ministral3": Ministral3ForCausalLM}
CONFIGS = {"qwen3": qwen3_config, "llama": llama3_config, "ministral3": ministral3_config}


def tiny_model(family="qwen3", seed=0, name=None, **shape):
    """A float32 eval-mode model of `family` with random weights from `seed`."""
    config = CONFIGS[family](**shape)
    torch.manual_seed(seed)
    model = _CLASSES[config.model_type](config).float().eval()
    model.name_or_path = name or f"tiny-{family}-{seed}"
    return model


def random_ids(batch, seq, seed=0):
    """Token ids [batch, seq] from a fixed seed (ids avoid 0 so pads are distinguishable)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seq), generator=g)
