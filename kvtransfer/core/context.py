"""What sits at position 0 of every context: one convention shared by calibration and evaluation.

Position 0 is the attention sink: most attention mass lands on it and its K/V are outliers. A map
fitted on sequences whose position 0 holds one kind of token and applied to contexts whose position
0 holds another (e.g. calibration text starts with a word, a perplexity context starts with
`<|endoftext|>`) maps a sink it has never seen. So a run names one convention and every protocol
uses it:

    tokenizer      position 0 holds whatever the tokenizer itself adds before text (Llama: BOS;
                   Qwen: nothing, so the first text token). Equals stock lm-eval `hf` scoring.
    prefix_token   position 0 always holds lm-eval's prefix token (BOS, else EOS), also for
                   tokenizers that add nothing: every context starts with the same token.

The convention is recorded in the calibration provenance (and so in the mapper) and checked
when a mapper is used for evaluation.
"""
from __future__ import annotations

import warnings

CONTEXT_STARTS = ("tokenizer", "prefix_token")


class ContextStartMismatch(ValueError):
    """A mapper calibrated under one position-0 convention is evaluated under another."""


def check_policy(policy: str) -> str:
    """Validate a context-start name; returns it."""
    if policy not in CONTEXT_STARTS:
        raise ValueError(f"context_start={policy!r}: use one of {CONTEXT_STARTS}")
    return policy


def prefix_token_id(tokenizer) -> int:
    """lm-eval's token for an empty context: BOS, else EOS."""
    tid = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if tid is None:
        raise ValueError("the tokenizer has neither BOS nor EOS: context_start needs one of them")
    return int(tid)


def tokenizer_start_ids(tokenizer) -> list[int]:
    """Ids the tokenizer itself puts before text with add_special_tokens=True (e.g. [BOS] or [])."""
    probe = "hello world"
    with_special = tokenizer(probe, add_special_tokens=True)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    n = len(with_special) - len(plain)
    if n < 0 or with_special[n:] != plain:
        raise ValueError("cannot tell which special tokens this tokenizer adds before text")
    return list(with_special[:n])


def start_ids(tokenizer, policy: str) -> list[int]:
    """Token ids every context starts with under `policy` (may be empty for `tokenizer`)."""
    if check_policy(policy) == "prefix_token":
        return [prefix_token_id(tokenizer)]
    return tokenizer_start_ids(tokenizer)


def encode(tokenizer, text: str, policy: str) -> list[int]:
    """`text` as a context under `policy`: start ids + the text's own tokens (never twice)."""
    start = start_ids(tokenizer, policy)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if start and ids[:len(start)] == start else start + ids


def describe(tokenizer, policy: str) -> dict:
    """Provenance record: {"context_start": policy, "start_ids": [...], "start_tokens": [...]}."""
    ids = start_ids(tokenizer, policy)
    return {"context_start": policy, "start_ids": ids, "start_tokens": tokenizer.convert_ids_to_tokens(ids)}


def check_mapper(calibration: dict, policy: str, *, strict: bool = True) -> None:
    """Refuse (strict) or warn when a mapper's calibration used another position-0 convention.

    Mappers saved before the convention was recorded only warn (unknown is not a mismatch proof).
    """
    fitted = calibration.get("context_start")
    if fitted is None:
        warnings.warn("the mapper does not record its calibration's context_start (position-0 convention); "
                      f"evaluating under {policy!r} -- refit to make this checkable", stacklevel=3)
        return
    if fitted != policy:
        msg = (f"the mapper was calibrated with context_start={fitted!r} but evaluation uses {policy!r}: position 0 "
               "(the attention sink) would hold a token the map never saw. Set context_start="
               f"{fitted!r} for evaluation, or recalibrate with context_start={policy!r}")
        if strict:
            raise ContextStartMismatch(msg)
        warnings.warn(msg, stacklevel=3)
