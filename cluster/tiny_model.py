"""Tiny random-weight checkpoints with a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers`
on the text in cluster/corpus/, the weights are drawn from a seeded generator.
The same (arch, seed) always writes the same files, so tests on two machines see
the same model. The checkpoint loads in vLLM and in transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CORPUS_DIR = Path(__file__).parent / "corpus"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen models use; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    """Model shape; small enough that a 6K-token prefill takes well under a second on one core."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 32768
    # Larger than the usual 0.02 so greedy decoding of random weights has clear
    # winners: near-ties would make token-equality checks flaky.
    initializer_range: float = 0.25


ARCHS = ("qwen3", "llama", "gemma3", "gptoss")
# gemma3: 5 sliding-window layers (window 256 tokens: two 128-token blocks) and 1 full-attention
# layer, as the probes ran it; vLLM gives it one KV-cache group per kind.
GEMMA3_WINDOW = 256
# gptoss: 4 layers alternating sliding window (128) and full attention, attention sinks, 8 experts (top 2).
GPTOSS_WINDOW = 128


def train_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained on the shipped corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text() for p in sorted(CORPUS_DIR.glob("*.txt"))]
    assert texts, f"no corpus text in {CORPUS_DIR}: the package data is missing"
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def make_tiny_model(out_dir: str | Path, arch: str = "qwen3", seed: int = 0,
                    shape: TinyShape = TinyShape()) -> Path:
    """Write a tokenizer and a random-weight `arch` checkpoint to `out_dir`; return it."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = shape.max_position_embeddings
    tokenizer.save_pretrained(out)

    vocab_size = len(tokenizer)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "gemma3":
        common.update(num_hidden_layers=6, sliding_window=GEMMA3_WINDOW,
                      layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=shape.head_dim)
        config = Gemma3TextConfig(**common)
        config.architectures = ["Gemma3ForCausalLM"]
        model_cls = Gemma3ForCausalLM
    elif arch == "gptoss":
        common.update(num_hidden_layers=4, sliding_window=GPTOSS_WINDOW, intermediate_size=shape.hidden_size,
                      layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=8,
                      num_experts_per_tok=2, tie_word_embeddings=False)
        config = GptOssConfig(**common)
        config.architectures = ["GptOssForCausalLM"]
        model_cls = GptOssForCausalLM
    else:
        config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
        config = config_cls(**common)
    config.dtype = torch.float32

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "pdcluster_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed, **shape.__dict__}, indent=1))
    return out
