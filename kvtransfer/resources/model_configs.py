"""The one table of the shipped pairs' models: text-stack config fields and tokenizer facts, keyed by
Hugging Face id, each value with its source.

Who reads it: the resource plan (kvtransfer.plan builds the real transformers config class from
`MODEL_CONFIGS[id]`, `AutoConfig.for_model(model_type, **fields)`, so it knows every shape without
weights or hub access), the shapes-only benchmark (kvtransfer.bench.shapes.MODELS are rows of this
table), the dry run's stand-ins (kvtransfer.dryrun: the real config class with these fields, widths
shrunk) and the preflight, which on a machine that reaches the hub compares each row with the real
config.json and stops on a difference (`compare_config`). A pair with `pair.<side>.path` set reads
that directory's own config.json instead.

SOURCES (`FIELD_SOURCES`, per model and field): every value is the model's public config.json on the
hub (URL in `CONFIG_URL`), written from memory of those files -- they are widely reproduced and match
the published parameter counts (tests/test_plan.py checks the counts) -- except the values listed in
`ASSUMED`, which no public copy we know of confirms:
- Ministral 3 (Reasoning 2512) is a `mistral3` vision-language checkpoint; only its text stack
  (`text_config`, model_type ministral3) is listed. 14B's intermediate size (16384) and the vocab of
  all three (131072) are assumptions.
- `load_extra_params` is what loading the VLM materialises beyond the text stack (vision encoder +
  projector, dropped after loading); ~0.42B is an assumption (a Pixtral-style 24-layer, 1024-wide encoder).
- Tokenizer facts (`TOKENIZERS`): special-token ids from each model's tokenizer_config.json /
  generation_config.json, recalled the same way; Ministral's pad id is an assumption.
None of these could be checked on the machine this table was written on (no hub access); the
preflight of any run on a machine with hub access checks them (kvtransfer.dryrun.preflight).
"""
from __future__ import annotations

CONFIG_URL = "https://huggingface.co/{id}/blob/main/config.json"
TOKENIZER_URL = "https://huggingface.co/{id}/blob/main/tokenizer_config.json"

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6,
              max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
               rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
_LLAMA31 = dict(model_type="llama", vocab_size=128256, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-5,
                max_position_embeddings=131072, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
_MINISTRAL3 = dict(model_type="ministral3", vocab_size=131072, head_dim=128, num_key_value_heads=8,
                   rms_norm_eps=1e-5, max_position_embeddings=262144, load_extra_params=420_000_000,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                    "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                    "llama_4_scaling_beta": 0.1})


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

# The checkpoint's top-level model_type where the text stack is nested (config.json -> text_config)
CHECKPOINT_TYPE = {hub_id: "mistral3" for hub_id in MODEL_CONFIGS if hub_id.startswith("mistralai/Ministral-3-")}

# (hub id, field) -> why the value is not sourced from a public config.json
ASSUMED: dict[tuple[str, str], str] = {
    ("mistralai/Ministral-3-14B-Reasoning-2512", "intermediate_size"): "assumed (a public test config gives "
                                                                      "hidden/layers/heads, not this)",
    **{(i, "vocab_size"): "assumed (tekken vocabulary of earlier Mistral models)" for i in CHECKPOINT_TYPE},
    **{(i, "load_extra_params"): "assumed (Pixtral-style 24-layer 1024-wide encoder + projector)"
       for i in CHECKPOINT_TYPE},
    ("mistralai/Ministral-3-3B-Reasoning-2512", "pad_token_id"): "assumed (tekken <pad> = 11)",
    ("mistralai/Ministral-3-8B-Reasoning-2512", "pad_token_id"): "assumed (tekken <pad> = 11)",
    ("mistralai/Ministral-3-14B-Reasoning-2512", "pad_token_id"): "assumed (tekken <pad> = 11)",
}

_QWEN_TOK = dict(bos_token_id=None, eos_token_id=151645, pad_token_id=151643, add_bos=False,
                 special={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645})
_LLAMA_TOK = dict(bos_token_id=128000, eos_token_id=128001, pad_token_id=None, add_bos=True,
                  special={"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001})
_MISTRAL_TOK = dict(bos_token_id=1, eos_token_id=2, pad_token_id=11, add_bos=True,
                    special={"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 11})
# hub id -> what the stand-in tokenizer reproduces: special ids (and tokens), whether encode() prepends BOS
TOKENIZERS: dict[str, dict] = {
    **{i: _QWEN_TOK for i in MODEL_CONFIGS if i.startswith("Qwen/")},
    **{i: _LLAMA_TOK for i in MODEL_CONFIGS if i.startswith("meta-llama/")},
    **{i: _MISTRAL_TOK for i in MODEL_CONFIGS if i.startswith("mistralai/")},
}


def field_source(hub_id: str, field: str) -> str:
    """Where the table's value of `field` for `hub_id` comes from: a URL, or why it is an assumption."""
    if (hub_id, field) in ASSUMED:
        return "ASSUMPTION: " + ASSUMED[(hub_id, field)]
    if field in TOKENIZERS.get(hub_id, {}):
        return TOKENIZER_URL.format(id=hub_id) + " (recalled, verified by the online preflight)"
    return CONFIG_URL.format(id=hub_id) + " (recalled, verified by the online preflight)"


def table_rows() -> list[dict]:
    """The table flattened: one {"id", "field", "value", "source", "assumption"} per value (for docs and tests)."""
    rows = []
    for hub_id, fields in MODEL_CONFIGS.items():
        tok = {k: v for k, v in TOKENIZERS[hub_id].items() if k != "special"}
        for field, value in {**fields, **tok}.items():
            rows.append({"id": hub_id, "field": field, "value": value, "source": field_source(hub_id, field),
                         "assumption": (hub_id, field) in ASSUMED})
    return rows


# config.json fields the table does not hold, or holds in another form: not compared
_NOT_COMPARED = {"load_extra_params"}


def compare_config(hub_id: str, real: dict) -> list[str]:
    """Differences between the table's row for `hub_id` and the checkpoint's real config.json (`real`, a
    dict; for a mistral3 checkpoint its `text_config` is compared). One line per differing field:
    "<id>: <field> table <v> != config.json <v> (<source>)". An empty list means they agree."""
    text = real.get("text_config") if CHECKPOINT_TYPE.get(hub_id) else real
    if CHECKPOINT_TYPE.get(hub_id) and real.get("model_type") != CHECKPOINT_TYPE[hub_id]:
        return [f"{hub_id}: model_type table {CHECKPOINT_TYPE[hub_id]} != config.json {real.get('model_type')}"]
    text = dict(text or {})
    if "rope_parameters" not in text and "rope_theta" in text:  # config.json written before transformers 5
        text["rope_parameters"] = dict(text.get("rope_scaling") or {"rope_type": "default"},
                                       rope_theta=text["rope_theta"])
    out = []
    for field, value in MODEL_CONFIGS[hub_id].items():
        if field in _NOT_COMPARED or field not in text and field == "head_dim":
            continue
        got = text.get(field)
        if field == "rope_parameters" and isinstance(got, dict):
            got = {k: v for k, v in got.items() if k in value or k == "rope_type"}
            got.setdefault("rope_type", got.pop("type", "default"))
        if got != value:
            out.append(f"{hub_id}: {field} table {value!r} != config.json {got!r} ({field_source(hub_id, field)})")
    return out
