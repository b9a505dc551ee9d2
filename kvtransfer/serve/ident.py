"""Weights identity for serving: a model is its architecture *and* its weights (kvtransfer.config.identity).

The store keys every block by the producer's `key` (below), the consumer looks blocks up under the key
of its `source_model`, the mapper's pair check compares weights where the mapper records them, and the
target's native-sink cache is named by the target's key -- so a fine-tune and its base (same config,
other weights) never share entries, maps or sinks.

    serving_identity(ref) -> {"model_id", "config_hash", "n_layers", "n_kv", "head_dim", "rope_type",
                              "weights": kvtransfer.config.identity.weights_identity(ref), "key": 16 hex}
"""
from __future__ import annotations

import hashlib
import json

from ..core.models import config_hash, kv_shape, rope_type, text_config


def identity_from_config(config, model_id: str = "") -> dict:
    """The architecture part of a model's identity, known from its config alone (no weights read)."""
    shape = kv_shape(config)
    return {"model_id": model_id, "config_hash": config_hash(text_config(config)), "n_layers": shape.n_layers,
            "n_kv": shape.n_kv, "head_dim": shape.head_dim, "rope_type": rope_type(config)}


def weights_key(config_hash_: str, weights: dict) -> str:
    """16-hex key of (architecture, weights): what store blocks and sink files are named by."""
    blob = json.dumps({"config_hash": config_hash_, "weights": weights}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def with_weights(identity: dict, weights: dict) -> dict:
    """`identity` (identity_from_config / model_identity) plus its "weights" and the derived "key"."""
    return {**identity, "weights": weights, "key": weights_key(identity["config_hash"], weights)}


def serving_identity(ref: str, config=None) -> dict:
    """Full identity of the model a server loads from `ref` (a local directory or a cached hub id).

    config: its HF config when already read (else AutoConfig.from_pretrained(ref)). Raises
    FileNotFoundError / ValueError (kvtransfer.config.identity.weights_identity) when the weights cannot be identified.
    """
    from ..config.identity import weights_identity

    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(ref)
    return with_weights(identity_from_config(config, str(ref)), weights_identity(str(ref)))


def model_serving_identity(model, ref: str | None = None) -> dict:
    """serving_identity of an in-memory HF model saved at `ref` (default: its name_or_path)."""
    from ..config.identity import weights_identity
    from ..core.models import model_identity

    ref = str(ref or model.name_or_path)
    return with_weights(model_identity(model), weights_identity(ref))
