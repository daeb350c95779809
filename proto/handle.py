"""The transfer handle: where a prefill's KV lives, as D needs it.

The router names every P->D transfer (`transfer_id`) and tells P through
kv_transfer_params {PRODUCE_KEY: transfer_id}. D gets the handle: in push mode
the router builds it before P starts, so D can ask P for blocks while P still
computes them; in pull mode P's connector returns it when the prefill finishes.
vLLM carries kv_transfer_params as a plain dict, so the handle converts at that
boundary only (`to_params` / `from_params`) and is typed everywhere else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Keys of kv_transfer_params. PRODUCE on P's request (value: the transfer id);
# HANDLE on D's.
PRODUCE_KEY = "pdc_produce"
HANDLE_KEY = "pdc_handle"
# A request's retention hint (the API's `kv_retention_s`), to P's and D's connectors: their host
# tiers evict its prompt's blocks after every block without one, for up to this long.
RETAIN_KEY = "pdc_retain_s"
MAX_RETENTION_S = 3600.0
TRANSPORTS = ("grpc", "torch_dist")


class HandleError(ValueError):
    """kv_transfer_params that do not describe a transfer."""


@dataclass(frozen=True)
class TransferHandle:
    engine_id: str  # P's engine id
    address: str  # "host:port" of P's KV server
    transfer_id: str  # the router's name for this transfer; P keys its source by it
    num_tokens: int  # prompt tokens whose KV P computes, from token 0
    # How the bytes travel: inside the gRPC stream, or over a torch.distributed pair
    # channel that the gRPC stream only announces (transfer/channels.py).
    transport: str = "grpc"

    def __post_init__(self):
        if self.num_tokens < 0:
            raise HandleError(f"bad token count: num_tokens={self.num_tokens}")
        if ":" not in self.address:
            raise HandleError(f"address {self.address!r} is not host:port")
        if not self.transfer_id:
            raise HandleError("empty transfer_id")
        if self.transport not in TRANSPORTS:
            raise HandleError(f"unknown transport {self.transport!r}; one of {TRANSPORTS}")

    def to_params(self) -> dict:
        return {HANDLE_KEY: asdict(self)}

    @classmethod
    def from_params(cls, params: dict | None) -> TransferHandle | None:
        """The handle in kv_transfer_params, or None if there is none."""
        if not params or HANDLE_KEY not in params:
            return None
        d = params[HANDLE_KEY]
        if not isinstance(d, dict):
            raise HandleError(f"malformed transfer handle {d!r}: not a dict")
        try:
            return cls(engine_id=str(d["engine_id"]), address=str(d["address"]),
                       transfer_id=str(d["transfer_id"]), num_tokens=int(d["num_tokens"]),
                       transport=str(d.get("transport", "grpc")))
        except (KeyError, TypeError, ValueError) as err:
            raise HandleError(f"malformed transfer handle {d!r}: {err}") from None


def transfer_id_of(params: dict | None) -> str | None:
    """P side: the transfer id the router asked this request to produce, if any."""
    value = (params or {}).get(PRODUCE_KEY)
    return value if isinstance(value, str) and value else None
