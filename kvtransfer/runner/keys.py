"""Artifact keys of the runner: a short hash of exactly the config that produced an artifact.

A leaf module (standard library only), so the pipeline and the eval and bench stages share it
without importing one another.
"""
from __future__ import annotations

import hashlib
import json


def artifact_key(*parts) -> str:
    """16-hex-digit key of JSON-able parts (the config that produced an artifact)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
