"""What an engine actor asks its engine's worker, beside the KV tensors: the engine's KV-cache
groups (for the router's prefix index), its host tier's counts, and the pool's side (issue 29 item
2): offering a peer a run of a prompt's first blocks from the host tier, and the block hashes that
name them.

vLLM mixes `PoolWorkerExtension` into its worker class (engine arg `worker_extension_cls`), so
`AsyncLLM.collective_rpc("pdc_open_pool", ...)` runs it beside the KV tensors, on the worker's
thread between two steps; it hands over to the connector's worker (`_Worker.open_pool`,
transfer/connector_worker.py), which pins the run and offers it to P's KV server as a transfer
source a peer then pulls like a prefill's.

`prompt_block_hashes` works out a prompt's block hashes as the engine's scheduler does (vLLM's
`hash_block_tokens` chained from its NONE_HASH, with the engine's hash algorithm), in the actor's
process: the tier's blocks are keyed by them (transfer/tier_scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence

EXTENSION = f"{__name__}.PoolWorkerExtension"


class PoolWorkerExtension:
    """Methods vLLM adds to its worker; no state of their own."""

    def pdc_open_pool(self, transfer_id: str, hashes: list[bytes]) -> int:
        """Offer the run of `hashes` this instance's host tier holds as transfer `transfer_id`: the
        prompt tokens it covers (0: none held, or no tier here)."""
        worker = _connector_worker()
        return worker.open_pool(transfer_id, [bytes(h) for h in hashes]) if worker is not None else 0

    def pdc_kv_groups(self) -> list[dict]:
        """The engine's KV-cache groups as proto/kv_groups.py KvGroup dicts, in vLLM's order."""
        from dataclasses import asdict

        return [asdict(g.shape) for g in getattr(_connector(), "groups", ())]

    def pdc_tier_counts(self) -> dict | None:
        """This instance's host tier's counts (proto/messages.py TierCounts, as a dict: collective_rpc's
        answers cross processes by msgpack), None without a tier."""
        from dataclasses import asdict

        tier = getattr(_connector_worker(), "tier", None)
        return asdict(tier.counted()) if tier is not None else None


def _connector():
    """This worker's KV connector (ours, or another's), None without one."""
    from pdcluster.transfer.vllm_compat import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _connector_worker():
    """This worker's pdcluster connector's worker side (transfer/connector_worker.py), None without one."""
    return getattr(_connector(), "_worker", None)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, hash_algo: str = "sha256") -> list[bytes]:
    """vLLM's block hashes of every full block of `token_ids` before its last token (a reader
    computes that one), as its scheduler hashes a request's blocks (no extra keys: no LoRA, no
    multimodal inputs, no cache salt)."""
    from vllm.v1.core import kv_cache_utils

    from pdcluster.transfer import vllm_compat as v

    hash_fn = v.get_hash_fn_by_name(hash_algo)
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:  # the engine core's process sets it; the actor's not
        v.init_none_hash(hash_fn)
    out: list[bytes] = []
    parent = None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = v.hash_block_tokens(hash_fn, parent, tuple(token_ids[start:start + block_size]))
        out.append(bytes(parent))
    return out
