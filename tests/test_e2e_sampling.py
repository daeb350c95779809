"""D's sampling parameters through P/D on real vLLM engines (issue 30; router/sampling_checks.py):
each acts on the answer; and the prompt's logprobs come from P's prefill, equal to a single
engine's, with nothing held after. That answers equal vllm serve's, penalties and logprobs
included, is tests/test_e2e_vllm_serve.py's."""

from __future__ import annotations

import random

import pytest
import ray
from e2e import (
    assert_no_kv_in_use,
    complete,
    p1d1_spec,
    shared_cluster,
    shared_reference,
    tiny_model_dir,
)

from pdcluster.proto.messages import SamplingSpec

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p1d1")]
PROMPT = [random.Random(30).randrange(3, 1000) for _ in range(300)]


@pytest.fixture(scope="module")
def cluster():
    return shared_cluster("p1d1", p1d1_spec)


def answer(cluster, **params) -> list[int]:
    r = complete(cluster.url, PROMPT, 12, **params)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_forced_token_a_whitelist_and_a_ban_each_act_on_ds_answer(cluster):
    plain = answer(cluster)
    forced = next(t for t in range(5, 1000) if t not in plain)
    assert answer(cluster, logit_bias={str(forced): 100}) == [forced] * 12
    allowed = {plain[0], forced}
    assert set(answer(cluster, allowed_token_ids=sorted(allowed))) <= allowed
    from transformers import AutoTokenizer

    word = AutoTokenizer.from_pretrained(tiny_model_dir()).decode([plain[0]]).strip()
    banned = answer(cluster, bad_words=[word])
    assert plain[0] not in banned and banned != plain, (word, banned)


def test_prompt_logprobs_come_from_ps_prefill_and_equal_a_single_engines(cluster):
    top = 5
    r = complete(cluster.url, PROMPT, 4, prompt_logprobs=top)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    want = ray.get(shared_reference().prompt_logprobs.remote(PROMPT, SamplingSpec(max_tokens=1, prompt_logprobs=top)))
    assert got[0] is None and len(got) == len(PROMPT) == len(want)
    for g, w in zip(got[1:], want[1:]):
        assert [int(t) for t in g] == list(w.token_ids)
        assert [e["logprob"] for e in g.values()] == pytest.approx(list(w.logprobs), abs=1e-3)
        assert [e["rank"] for e in g.values()] == list(w.ranks)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # vLLM reads no cached prefix for them
    assert_no_kv_in_use(cluster)  # P's leases ended though its connector's matches were set aside
