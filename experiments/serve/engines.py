"""Shared pieces of the serving proofs: vLLM engines with kvtransfer's connector, and their outputs as JSON.

Import only under `if __name__ == "__main__":` in the calling script (vLLM spawns its engine process).
"""
from __future__ import annotations

import gc
import os
import time


def kv_config(role: str, store, **extra) -> dict:
    """--kv-transfer-config of kvtransfer's connector (role: kv_producer | kv_consumer)."""
    return {"kv_connector": "KVTransferConnector", "kv_connector_module_path": "kvtransfer.serve.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store), **{k: str(v) if hasattr(v, "is_dir") else v
                                                                  for k, v in extra.items()}}}


def engine(model, *, dtype="float32", kv=None, prefix_caching=False, max_model_len=2048, **kw):
    """An offline vLLM engine (eager, no prefix caching unless asked)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM

    return LLM(model=str(model), dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
               enable_prefix_caching=prefix_caching, kv_transfer_config=kv, **kw)


def close(llm) -> None:
    """Shut an engine down before the next one starts (its engine process and memory)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 -- older/newer engines: deleting is enough
        pass
    del llm
    gc.collect()


def generate(llm, prompts: list[list[int]], max_tokens: int, *, logprobs: int = 5, salt: str | None = None,
             params: dict | None = None) -> list[dict]:
    """Greedy outputs, one dict per prompt: tokens, first-token top-`logprobs` {id: logprob}, seconds (per call)."""
    from vllm import SamplingParams

    out = []
    for ids in prompts:  # one request at a time: each timing is that request's own
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs,
                            extra_args={"kv_transfer_params": params} if params else None)
        prompt = {"prompt_token_ids": list(ids)} | ({"cache_salt": salt} if salt else {})
        t0 = time.perf_counter()
        request_out = llm.generate([prompt], sp, use_tqdm=False)[0]
        res = request_out.outputs[0]
        seconds = time.perf_counter() - t0
        first = {int(t): float(lp.logprob) for t, lp in res.logprobs[0].items()}
        out.append({"tokens": list(res.token_ids), "first_logprobs": first, "seconds": seconds,
                    "kv_transfer_params": getattr(request_out, "kv_transfer_params", None)})
    return out
