"""Moving a request off an instance that died under it (as NVIDIA Dynamo migrates requests).

When D dies or its connection is lost mid-stream, the router sends the request again, to a
live D, as a new request whose prompt is the original prompt plus every token the client has
already received, with the rest of the token budget: through P as any request (P's cache
still holds the original prompt), or on the new D alone when its cache makes the remainder
short (router/local_prefill.py). The client's stream goes on: the tokens D produced but the
router never received are produced again, none twice; with greedy sampling the output is the
single engine's. A P that dies before the first token is replaced the same way (after the
first token D has every layer's KV and needs nothing from P).

`router.migration_limit` bounds the moves per request; past it, or with no live instance of the
role left, the request ends with an error naming the lost instances. Each move is a
`Migration` in the request's record (router/timeline.py).
"""

from __future__ import annotations

import dataclasses

from pdcluster.proto.messages import SamplingSpec
from pdcluster.router.backend import BackendError


class InstanceLost(BackendError):
    """The instance serving a request died or was cut off: a 503 naming it, unless migrated."""

    def __init__(self, role: str, instance: str, why: str):
        super().__init__(f"{role} instance {instance} is unavailable: {why}", 503, "service_unavailable")
        self.role, self.instance = role, instance


def continuation(prompt: list[int], sampling: SamplingSpec, sent: list[int]) -> tuple[list[int], SamplingSpec]:
    """The request that carries on after `sent` (tokens the client has): the prompt grows by
    them and the budget shrinks by as many, so prompt + max_tokens is what it was."""
    assert len(sent) < sampling.max_tokens, "nothing left to generate: the request is finished, not migrated"
    return prompt + sent, dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(sent))
