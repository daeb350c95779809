"""The transfer handle: where a finished prefill's KV lives, as D needs it.

P's connector returns it from `request_finished` inside vLLM's
`kv_transfer_params`; the router carries it to D, whose connector reads it back.
vLLM carries kv_transfer_params as a plain dict, so the handle converts at that
boundary only (`to_params` / `from_params`) and is typed everywhere else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Keys of kv_transfer_params. The router sets PRODUCE on P's request; P's
# connector answers with HANDLE, which the router passes to D unchanged.
PRODUCE_KEY = "pdc_produce"
HANDLE_KEY = "pdc_handle"


class HandleError(ValueError):
    """kv_transfer_params that do not describe a transfer."""


@dataclass(frozen=True)
class TransferHandle:
    engine_id: str  # P's engine id
    address: str  # "host:port" of P's KV server
    request_id: str  # P's request id: the key of its lease
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group, P's block ids in token order
    num_tokens: int  # prompt tokens whose KV P holds, from token 0

    def __post_init__(self):
        if self.num_tokens < 0:
            raise HandleError(f"bad token count: num_tokens={self.num_tokens}")
        if ":" not in self.address:
            raise HandleError(f"address {self.address!r} is not host:port")

    def to_params(self) -> dict:
        d = asdict(self)
        d["block_ids"] = [list(g) for g in self.block_ids]
        return {HANDLE_KEY: d}

    @classmethod
    def from_params(cls, params: dict | None) -> TransferHandle | None:
        """The handle in kv_transfer_params, or None if there is none."""
        if not params or HANDLE_KEY not in params:
            return None
        d = params[HANDLE_KEY]
        if not isinstance(d, dict) or not isinstance(d.get("block_ids"), list) or not all(
                isinstance(g, list) for g in d["block_ids"]):
            raise HandleError(f"malformed transfer handle {d!r}: block_ids must be a list of lists")
        try:
            return cls(
                engine_id=str(d["engine_id"]), address=str(d["address"]), request_id=str(d["request_id"]),
                block_ids=tuple(tuple(int(b) for b in g) for g in d["block_ids"]),
                num_tokens=int(d["num_tokens"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise HandleError(f"malformed transfer handle {d!r}: {err}") from None
