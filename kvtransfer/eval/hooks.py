"""lm-eval hooks of the `kvtransfer` model (kvtransfer.eval.adapter.KVTransferLM) that need none of its state
beyond its public attributes: run metadata and the rolling log-likelihood (refused in split modes)."""
from __future__ import annotations

from lm_eval import utils as lm_utils

SPLIT_MODES = ("transfer", "native_injected", "identity")  # the cache is built apart from the scorer


def model_info(self) -> dict:
    """Run metadata for lm-eval's results: mode, model ids, mapper pair and k."""
    ident = lambda m: None if m is None else str(getattr(m, "name_or_path", ""))  # noqa: E731
    info = {"kvtransfer_mode": self.mode, "wrong_context": self.wrong_context,
            "source": ident(self.source_model), "target": ident(self.target_model),
            "native_sink": self.native_sink, "native_tail": self.native_tail, "max_length": self.max_length,
            "context_start": self.context_start}
    if self.mapper is not None:
        info["mapper"] = {"k": self.mapper.k, "key_space": self.mapper.key_space, "lambda": self.mapper.lam,
                          "source": self.mapper.source.get("model_id"), "target": self.mapper.target.get("model_id")}
    return info


def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Rolling-window log-likelihood; only in `target` / `source` mode (see the PPL protocol)."""
    if self.mode in SPLIT_MODES:
        raise NotImplementedError(
            "loglikelihood_rolling gives every window a 1-token context, so through a transferred cache it "
            "silently becomes native perplexity. Use kvtransfer.eval.perplexity.prefix_conditioned_ppl "
            "(the source prefills P tokens, the target scores a fixed continuation).")
    results = []
    for (string,) in [req.args for req in requests]:
        windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
            token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length, context_len=1)]
        total = float(sum(lp.sum() for lp, _ in self.score_tokens(windows)))
        self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        results.append(total)
    return results
