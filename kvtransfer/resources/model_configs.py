"""Text-stack config fields of the models the shipped pairs name, keyed by Hugging Face id.

The resource plan (kvtransfer.plan) builds the real transformers config class from these fields
(`AutoConfig.for_model(model_type, **fields)`), so it knows every shape without weights or hub
access. A pair with `pair.<side>.path` set reads that directory's own config.json instead.

SOURCE: written from memory of the public config.json files on the Hugging Face hub (Qwen3
0.6B/1.7B/8B/14B/32B, Qwen2.5-Coder 0.5B/1.5B Instruct, Llama 3.1 8B/70B) -- these are widely
reproduced and match the published parameter counts (e.g. Qwen3-14B 14.8B, Qwen3-32B 32.8B,
Llama-3.1-70B 70.6B; tests/test_plan.py checks the counts). Ministral 3 (Reasoning 2512) is a
`mistral3` vision-language checkpoint; only its text stack is listed. Its fields follow
kvtransfer/bench/shapes.py's table: 3B and 8B from public config copies, 14B's intermediate size (16384)
and the vocab (131072) are ASSUMPTIONS there and here. `load_extra_params` is what loading the
VLM materialises beyond the text stack (vision encoder + projector, dropped after loading); ~0.42B
is an ASSUMPTION (a Pixtral-style 24-layer, 1024-wide encoder). Verify against the real
config.json before trusting a Ministral figure to better than a few per cent.
"""
from __future__ import annotations

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8,
              max_position_embeddings=40960)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
_LLAMA31 = dict(model_type="llama", vocab_size=128256, head_dim=128, num_key_value_heads=8,
                max_position_embeddings=131072, tie_word_embeddings=False)
_MINISTRAL3 = dict(model_type="ministral3", vocab_size=131072, head_dim=128, num_key_value_heads=8,
                   max_position_embeddings=262144, load_extra_params=420_000_000)


def _m(base: dict, layers: int, hidden: int, heads: int, intermediate: int, **kw) -> dict:
    return dict(base, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                intermediate_size=intermediate, **kw)


MODEL_CONFIGS: dict[str, dict] = {
    # Qwen3 (q/k RMSNorm, no biases)
    "Qwen/Qwen3-0.6B": _m(_QWEN3, 28, 1024, 16, 3072, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": _m(_QWEN3, 28, 2048, 16, 6144, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": _m(_QWEN3, 36, 4096, 32, 12288, tie_word_embeddings=False),
    "Qwen/Qwen3-14B": _m(_QWEN3, 40, 5120, 40, 17408, tie_word_embeddings=False),
    "Qwen/Qwen3-32B": _m(_QWEN3, 64, 5120, 64, 25600, tie_word_embeddings=False),
    # Qwen2.5-Coder (q/k/v biases; head_dim = hidden / heads)
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": _m(_QWEN25, 24, 896, 14, 4864, num_key_value_heads=2),
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": _m(_QWEN25, 28, 1536, 12, 8960, num_key_value_heads=2),
    # Llama 3.1 base
    "meta-llama/Llama-3.1-8B": _m(_LLAMA31, 32, 4096, 32, 14336),
    "meta-llama/Llama-3.1-70B": _m(_LLAMA31, 80, 8192, 64, 28672),
    # Ministral 3 Reasoning 2512 (text stack of the mistral3 VLM)
    "mistralai/Ministral-3-3B-Reasoning-2512": _m(_MINISTRAL3, 26, 3072, 32, 9216, tie_word_embeddings=True),
    "mistralai/Ministral-3-8B-Reasoning-2512": _m(_MINISTRAL3, 34, 4096, 32, 14336, tie_word_embeddings=False),
    "mistralai/Ministral-3-14B-Reasoning-2512": _m(_MINISTRAL3, 40, 5120, 32, 16384, tie_word_embeddings=False),
}
