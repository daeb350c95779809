"""The model's own sampling defaults, applied to what a request leaves unset, as vLLM's server
applies them by default (`--generation-config auto`: vllm/config/model.py `get_diff_sampling_param`,
0.32): of the sampling parameters below, those its generation_config.json sets, as transformers'
`to_diff_dict` gives them to vLLM (`max_new_tokens` as `max_tokens`). A Qwen3 checkpoint,
for one, asks temperature 0.6, top_p 0.95, top_k 20: without them the router would sample
otherwise than `vllm serve` on the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PARAMS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p")


def model_sampling_defaults(model_dir: str | Path) -> tuple[tuple[str, Any], ...]:
    """(parameter, value) pairs from the model's generation config (none: ())."""
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(str(model_dir)).to_diff_dict()
    except OSError:  # no generation_config.json (vLLM then reads the model's config: no sampling fields)
        return ()
    found = {p: diff[p] for p in (*PARAMS, "max_new_tokens") if diff.get(p) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return tuple(found.items())


def with_defaults(req: Any, defaults: tuple[tuple[str, Any], ...]) -> Any:
    """The request with the model's defaults where it set nothing (the client's values win)."""
    unset = {name: value for name, value in defaults if name in PARAMS and getattr(req, name) is None}
    return req.model_copy(update=unset) if unset else req


def default_max_tokens(defaults: tuple[tuple[str, Any], ...]) -> int | None:
    """The model's cap on an answer whose request names none (vLLM's fallback in get_max_tokens)."""
    return next((int(v) for name, v in defaults if name == "max_tokens"), None)
