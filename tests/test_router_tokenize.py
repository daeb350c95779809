"""vLLM's /tokenize and /detokenize on the router (vLLM's bench client asks for them), and the
tokenizer it reports in /v1/models: over the fake backend, against the tokenizer itself."""

from __future__ import annotations

from router_fakes import MAX_LEN, MODEL, bad_request


def test_tokenize_a_prompt_as_the_tokenizer_does(fake_router, tok):
    client, _ = fake_router()
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "hello there"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(tok.encode("hello there")), "max_model_len": MAX_LEN,
                        "tokens": tok.encode("hello there"), "token_strs": None}


def test_tokenize_messages_applies_the_chat_template(fake_router, tok):
    client, _ = fake_router()
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/tokenize", json={"messages": messages})
    assert r.json()["tokens"] == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False))


def test_detokenize_is_the_tokenizers_decode(fake_router, tok):
    client, _ = fake_router()
    ids = tok.encode("hello there")
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tok.decode(ids)}


def test_bad_tokenize_and_detokenize_bodies_are_400s_naming_the_field(fake_router, tok):
    client, _ = fake_router()
    assert "one of 'prompt' or 'messages'" in bad_request(client, "/tokenize", {"model": MODEL})["message"]
    err = bad_request(client, "/detokenize", {"tokens": [1, len(tok) + 5]})
    assert err["param"] == "tokens" and f"token id {len(tok) + 5} at index 1 is out of range" in err["message"]
    assert bad_request(client, "/detokenize", {"tokens": "abc"})["param"] == "tokens"
    assert client.post("/detokenize", json={"model": "other", "tokens": [1]}).status_code == 404


def test_models_names_where_the_tokenizer_is(fake_router, tok_dir):
    client, _ = fake_router()
    assert client.get("/v1/models").json()["data"][0]["root"] == tok_dir


def test_the_bench_takes_the_vocab_from_a_plain_vllm_servers_model_root(tok_dir, tok, monkeypatch):
    """vLLM's /v1/models names no vocab size, only `root`: the bench sizes its token ids from
    the tokenizer there, and asks for --vocab-size only when this machine has no such path."""
    import httpx

    from pdcluster.cluster.replay import run as bench_run

    def served(root):
        def get(url, **kw):
            body = {"data": [{"id": "m", "root": root}]} if url.endswith("/v1/models") else {}
            return httpx.Response(200 if url.endswith("/v1/models") else 404, json=body,
                                  request=httpx.Request("GET", url))
        return get

    monkeypatch.setattr(bench_run.httpx, "get", served(tok_dir))
    assert bench_run.server_info("http://vllm") == (len(tok), None)
    monkeypatch.setattr(bench_run.httpx, "get", served("/no/such/model"))
    assert bench_run.server_info("http://vllm") == (None, None)
