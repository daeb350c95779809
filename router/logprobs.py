"""Logprobs: the request's checks and the answer's shapes, as vLLM's server has them.

D's vLLM computes each generated token's logprob and its top alternatives (SamplingSpec.logprobs,
`TokenLogprobs` per token); this module checks what a client asks for with vLLM's bounds and
messages, and writes what comes back in OpenAI's shapes exactly as vLLM 0.32's server does
(vllm/entrypoints/openai/{completion,chat_completion}/serving.py): the same token strings, the
same -9999.0 for -inf, the same choice of alternatives. The engines run without a tokenizer, so
the token strings are made here, as vLLM's output processor makes them
(vllm/tokenizers/detokenizer_utils.py:convert_ids_list_to_tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdcluster.proto.messages import TokenLogprobs
from pdcluster.router.backend import ModelCard
from pdcluster.router.openai_models import ApiError

FLOOR = -9999.0  # OpenAI's stand-in for -inf, as vLLM writes it
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs, which the engines run with


def check_logprobs(value: int | None, param: str, card: ModelCard) -> int | None:
    """The number of alternatives asked for (-1: the vocabulary), checked as vLLM checks it."""
    return _checked_count(value, param, "sample", card)


def check_prompt_logprobs(value: int | None, stream: bool, card: ModelCard) -> int | None:
    """The prompt's logprobs asked for: vLLM's checks, and its bound."""
    if value is not None and stream and (value > 0 or value == -1):
        raise ApiError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    return _checked_count(value, "prompt_logprobs", "prompt", card)


def _checked_count(value: int | None, param: str, what: str, card: ModelCard) -> int | None:
    """A logprobs count (None: none asked): -1 or at least 0, the engines computing logits, at
    most MAX_LOGPROBS once -1 is the vocabulary; vLLM's words."""
    if value is None:
        return None
    if value < 0 and value != -1:
        raise ApiError(f"`{param}` must be a positive value or -1.", param=param)
    if not card.logits:
        raise ApiError(f"'{param}': the simulated engine computes no logits, so no logprobs", param=param)
    wanted = card.vocab_size if value == -1 else value
    if wanted > MAX_LOGPROBS:
        raise ApiError(f"Requested {what} logprobs of {wanted}, which is greater than max allowed: "
                       f"{MAX_LOGPROBS}", param=param)
    return value


def chat_logprobs_asked(logprobs: bool | None, top_logprobs: int | None, card: ModelCard) -> int | None:
    """Chat's pair: `logprobs` turns them on, `top_logprobs` (default 0) counts alternatives."""
    top = 0 if top_logprobs is None else top_logprobs
    if top < 0 and top != -1:
        raise ApiError("`top_logprobs` must be a positive value or -1.", param="top_logprobs")
    if top != 0 and not logprobs:
        raise ApiError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    return check_logprobs(top, "top_logprobs", card) if logprobs else None


class TokenTexts:
    """Token ids' texts as vLLM's output processor writes them in logprobs (its LogprobsProcessor):
    each id's own decode([id]), with the leading spaces a SentencePiece (Metaspace) vocabulary's
    marker stands for put back; one ending inside a UTF-8 character (U+FFFD) decoded again after
    up to 4 tokens before it at its position, as the character's rest, or "" while incomplete."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._marker = _space_marker(tokenizer)
        self._texts: dict[int, str] = {}

    def plain(self, token_id: int) -> str:
        """decode([id]) alone: vLLM's server's text for a token without logprobs (echo's first)."""
        return self._tokenizer.decode([token_id])

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) or ""
            if self._marker is not None:
                raw = self._tokenizer.convert_ids_to_tokens(token_id) or ""
                markers = len(raw) - len(raw.lstrip(self._marker))
                text = " " * max(0, markers - (len(text) - len(text.lstrip(" ")))) + text
            self._texts[token_id] = text
        return text

    def of(self, positions: Sequence[TokenLogprobs | None], context: Sequence[int] = ()) -> list[list[str] | None]:
        """Each position's entries' texts; `context`: the sequence's ids before the first position
        (a stream's earlier tokens). A position's own first id is the context of those after it."""
        before, out = list(context), []
        for p in positions:
            if p is None:
                out.append(None)
                continue
            out.append([self._completed(t, before[-4:]) if (text := self(t)).endswith("\ufffd") else text
                        for t in p.token_ids])
            before.append(p.token_ids[0])
        return out

    def _completed(self, token_id: int, context: list[int]) -> str:
        """vLLM's `_correct_decoded_token` (vllm/v1/engine/logprobs.py, 0.32)."""
        decode = self._tokenizer.decode
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full = decode(ctx + [token_id])
            if full.endswith("\ufffd"):
                continue
            clean_end = len(ctx)  # context tokens that end inside a character belong to this one's text
            while clean_end and decode([ctx[clean_end - 1]]).endswith("\ufffd"):
                clean_end -= 1
            prefix = decode(ctx[:clean_end]) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            return full[common:]
        return ""


def _space_marker(tokenizer: Any) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    for sub in [pre] + (pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else []):
        if sub.get("type") == "Metaspace":
            return sub.get("replacement", "▁")
    return None


def _pairs(position: TokenLogprobs, top: int, inclusive: bool) -> list[tuple[int, float]]:
    """The position's entries vLLM shows: completions the sampled one and `top` more
    (`i <= top`), chat the first `top` (`i < top`); -1: all."""
    pairs = zip(position.token_ids, position.logprobs)
    return [(t, max(lp, FLOOR)) for i, (t, lp) in enumerate(pairs) if top == -1 or i < top + inclusive]


def completion_logprobs(positions: Sequence[TokenLogprobs | None], decoded: Sequence[list[str] | None], top: int,
                        texts: TokenTexts, offset: int = 0, token_ids: Sequence[int] = ()) -> dict[str, list]:
    """/v1/completions' `logprobs` object; `decoded`: TokenTexts.of(positions); `offset`: the
    text's length before the first token. A position None (an echoed prompt's first) has no
    logprobs: its token is `token_ids`' there."""
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for i, (position, strings) in enumerate(zip(positions, decoded)):
        if position is None:
            token, logprob, alternatives = texts.plain(token_ids[i]), None, None
        else:
            token = strings[0]  # the sampled (or prompt) token is the position's first entry
            logprob = max(position.logprobs[0], FLOOR)
            alternatives = {s: lp for s, (_, lp) in zip(strings, _pairs(position, top, inclusive=True))}
        out["text_offset"].append(offset)
        out["token_logprobs"].append(logprob)
        out["tokens"].append(token)
        out["top_logprobs"].append(alternatives)
        offset += len(token)
    return out


def prompt_logprobs(positions: Sequence[TokenLogprobs | None], decoded: Sequence[list[str] | None]) -> list[dict | None]:
    """The `prompt_logprobs` list, as vLLM's server writes its dict[int, Logprob] per position:
    each entry the prompt token first, then the top ones, -inf as -9999.0."""
    return [None if p is None else
            {str(t): {"logprob": max(lp, FLOOR), "rank": rank, "decoded_token": text}
             for t, lp, rank, text in zip(p.token_ids, p.logprobs, p.ranks or (None,) * len(p.token_ids), strings)}
            for p, strings in zip(positions, decoded)]


def chat_logprobs(positions: Sequence[TokenLogprobs], decoded: Sequence[list[str]], top: int) -> dict[str, list]:
    """/v1/chat/completions' `logprobs` object."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [entry(strings[0], max(p.logprobs[0], FLOOR))
                        | {"top_logprobs": [entry(s, lp) for s, (_, lp) in zip(strings, _pairs(p, top, inclusive=False))]}
                        for p, strings in zip(positions, decoded)]}
