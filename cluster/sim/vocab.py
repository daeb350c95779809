"""The vocabulary a simulated engine draws output ids from: the served model's (its
config.json; the router tokenizes with that model's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path


def model_vocab(model_path: str) -> tuple[int, int | None]:
    """(vocab_size, eos_token_id) of the checkpoint the router tokenizes for."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"sim engine: cannot read the model's {path}: {err}") from None
    cfg = config.get("text_config", config)
    if "vocab_size" not in cfg:
        raise ValueError(f"sim engine: {path} has no vocab_size")
    eos = cfg.get("eos_token_id")
    return int(cfg["vocab_size"]), eos[0] if isinstance(eos, list) and eos else eos


def spec_vocab(spec) -> tuple[int, int | None]:
    """model_vocab of a ClusterSpec's model, generating the tiny model first if the spec asks
    for one and it is not there yet (as `pdc up` does)."""
    path = Path(spec.model.path)
    if not (path / "config.json").exists() and spec.model.tiny is not None:
        from pdcluster.cluster.tiny_model import make_tiny_model

        make_tiny_model(path, arch=spec.model.tiny.arch, seed=spec.model.tiny.seed)
    return model_vocab(str(path))
