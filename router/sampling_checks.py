"""The sampling parameters D's engine applies beyond the plain ones (issue 30): the three penalties,
min_p, min_tokens, logit_bias, allowed_token_ids and bad_words.

Each is checked here as vLLM's server checks it (vllm/sampling_params.py: the same bounds, the same
messages), so that a request vLLM refuses gets its 400 before any engine sees it, and then rides
in `SamplingSpec` to both engines' vLLM (cluster/engine_actor.py:sampling_params). D samples every
token the client gets, so D is where they act; P samples one token nobody reads. Penalties that
look at the prompt find it on D, which holds the whole prompt. The router applies min_tokens to
stop strings itself (router/openai_stream.py), as vLLM's detokenizer does.
"""

from __future__ import annotations

import math
from typing import Any

from pdcluster.router.openai_models import ApiError, CommonRequest

LOGIT_BIAS_BOUND = 100.0  # vLLM clamps each bias to [-100, 100], as OpenAI documents
MAX_BAD_WORD_TOKENINGS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default (the engines run with it)


def extra_sampling(req: CommonRequest, vocab_size: int, max_tokens: int, tokenizer: Any) -> dict[str, Any]:
    """SamplingSpec's fields for these parameters (none set: {}), or an ApiError naming the first
    one vLLM would refuse."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise ApiError(f"{name} must be in [-2, 2], got {value}.", param=name)
            out[name] = float(value)
    if (rep := req.repetition_penalty) is not None:
        if not math.isfinite(rep):
            raise ApiError(f"repetition_penalty must be a finite number, got {rep}.", param="repetition_penalty")
        if rep <= 0.0:
            raise ApiError(f"repetition_penalty must be greater than zero, got {rep}.", param="repetition_penalty")
        out["repetition_penalty"] = float(rep)
    if (min_p := req.min_p) is not None:
        if not 0.0 <= min_p <= 1.0:
            raise ApiError(f"min_p must be in [0, 1], got {min_p}.", param="min_p")
        out["min_p"] = float(min_p)
    if (min_tokens := req.min_tokens) is not None:
        if min_tokens < 0:
            raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", param="min_tokens")
        if min_tokens > max_tokens:
            raise ApiError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                           param="min_tokens")
        out["min_tokens"] = min_tokens
    if req.logit_bias:
        out["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    if (allowed := req.allowed_token_ids) is not None:
        if not allowed:
            raise ApiError("allowed_token_ids is not None and empty!", param="allowed_token_ids")
        _in_vocab(allowed, vocab_size, "allowed_token_ids")
        out["allowed_token_ids"] = tuple(allowed)
    if req.bad_words:
        if any(not word for word in req.bad_words):
            raise ApiError(f"bad_words cannot contain an empty string. Got bad_words={req.bad_words}",
                           param="bad_words")
        out["bad_words_token_ids"] = _bad_words_token_ids(tuple(dict.fromkeys(req.bad_words)), tokenizer)
    return out


def _logit_bias(bias: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs: keys read as integers, biases clamped, as vLLM's SamplingParams."""
    ids, bad = {}, []
    for key, value in bias.items():
        try:
            ids[int(key)] = min(LOGIT_BIAS_BOUND, max(-LOGIT_BIAS_BOUND, value))
        except ValueError:
            bad.append(key)
    if bad:
        raise ApiError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                       param="logit_bias")
    _in_vocab(ids, vocab_size, "logit_bias")
    return tuple(ids.items())


def _bad_words_token_ids(words: tuple[str, ...], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The words as vLLM tokenizes them (SamplingParams.update_from_tokenizer): each alone and
    after a space, the second kept when it is another token of the same length; at most
    MAX_BAD_WORD_TOKENINGS in all. Here, because the engines run without a tokenizer (the router
    tokenizes): vLLM would skip the words."""
    kept: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise ApiError("bad_words entries must tokenize to at least one token.", param="bad_words")
                continue
            if not prefix or (ids[0] != kept[-1][0] and len(ids) == len(kept[-1])):
                kept.append(ids)
                if len(kept) > MAX_BAD_WORD_TOKENINGS:
                    raise ApiError(f"Too many bad words after tokenization: {len(kept)}. The max number is "
                                   f"{MAX_BAD_WORD_TOKENINGS}.", param="bad_words")
    return tuple(map(tuple, kept))


def _in_vocab(token_ids, vocab_size: int, name: str) -> None:
    if invalid := [t for t in token_ids if not 0 <= t < vocab_size]:
        raise ApiError(f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. Vocabulary size: "
                       f"{vocab_size}", param=name)
