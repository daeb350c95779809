"""The model's own sampling defaults (router/generation_defaults.py), as vLLM's server applies
them: read from generation_config.json where they differ from transformers' defaults, used where
the request sets nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from pdcluster.router.generation_defaults import model_sampling_defaults

QWEN3_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "do_sample": True,
              "repetition_penalty": 1.0}


def model_with(tmp_path: Path, tok_dir: str, generation: dict | None) -> Path:
    shutil.copy(Path(tok_dir) / "config.json", tmp_path)
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_read_as_vllm_reads_them(tmp_path, tok_dir):
    assert dict(model_sampling_defaults(model_with(tmp_path, tok_dir, QWEN3_LIKE))) == \
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64, "repetition_penalty": 1.0}
    assert model_sampling_defaults(tok_dir) == ()  # the tiny model's asks nothing


def test_the_request_leaves_unset_what_the_model_fills_in(fake_router, tmp_path, tok_dir):
    client, backend = fake_router()
    backend.card = dataclasses.replace(backend.card, max_model_len=1 << 12,
                                       sampling_defaults=model_sampling_defaults(model_with(tmp_path, tok_dir, QWEN3_LIKE)))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.post("/v1/chat/completions", json={**chat, "temperature": 0, "top_k": -1, "max_tokens": 9}).status_code == 200
    model, client_set = backend.calls[0][2], backend.calls[1][2]
    assert (model.temperature, model.top_p, model.top_k, model.max_tokens) == (0.6, 0.95, 20, 64)
    assert (client_set.temperature, client_set.top_p, client_set.top_k, client_set.max_tokens) == (0.0, 0.95, 0, 9)
