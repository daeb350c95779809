"""The router's sections of the cluster spec (proto/spec.py): what users write under `router:`.

The router's modules that act on each section import it from here: admission.py (AdmissionSpec),
http_app.py (HttpLimits), local_prefill.py (LocalPrefillSpec), policies.py (Policy),
migration.py (the default limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Policy = Literal["round_robin", "least_load", "prefix_aware"]
POLICIES: tuple[str, ...] = Policy.__args__

DEFAULT_MIGRATION_LIMIT = 3  # moves per request off lost instances (router/migration.py)


class AdmissionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_in_flight: int | None = Field(None, ge=1, description="requests in flight per router process before a 429; "
                                                               "default: 2 x the sum of D's max_num_seqs")
    max_queue_s: float | None = Field(None, gt=0, description="predicted prefill seconds queued on the least-loaded "
                                                              "P before a 429; default: request_timeout_s / 2")


@dataclass(frozen=True)
class HttpLimits:
    """What one client may cost the router (spec: router.max_body_bytes, body_timeout_s, client_stall_s)."""

    # A 128K-token prompt is ~0.9 MB as JSON token ids, ~0.5-0.7 MB as text: 4x headroom.
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # from the headers to the body's last byte
    # A streaming client whose socket takes nothing for this long has stopped reading: its
    # request is aborted, as if it had gone (else it would hold its D slot and KV forever).
    stall_s: float = 30.0



LocalPolicy = Literal["never", "short_remainder", "always"]
# See bench/README.md "D prefills short remainders": the threshold measured on the tiny model
# and swept on the simulated P8+D8.
DEFAULT_MAX_TOKENS = 1024


class LocalPrefillSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: LocalPolicy = Field("never", description="never: every prefill on P; short_remainder: D prefills "
                                                     "what its own cache lacks when that is short; always: "
                                                     "every request on D alone, no disaggregation (with "
                                                     "prefill.instances 0: the virtual clock only)")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1,
                            description="D prefills a request itself when at most this many prompt tokens are "
                                        "not in its prefix cache")
    max_in_flight: int = Field(1, ge=1, description="local prefills one D runs at once")
    pool: bool = Field(True, description="D counts the prefix a P's host KV tier holds as its own: it reads "
                                         "it over the KV plane and computes the rest (docs/kv_tiers.md)")
    p_busy_s: float | None = Field(None, gt=0, description="D prefills whatever the remainder when the picked P "
                                                           "has this much predicted prefill queued (off: null)")
