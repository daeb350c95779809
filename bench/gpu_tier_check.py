"""The host tier's copies on an accelerator (issue 29's GPU check), prepared for a lent device machine.

CI and these machines have no GPU: the paged-KV reads and writes (transfer/paged_kv.py) and the
tier's copies (transfer/host_tier.py) have only run on CPU tensors. On a CUDA device this script
1. lays out KV caches as vLLM's GPU backends do (flash-attn: one tensor a layer, [2, num_blocks,
   block_size, kv_heads, head_dim]; MLA: [num_blocks, block_size, 576]), bf16, random;
2. checks bytes round-trip exactly: blocks stored to the tier, the device blocks overwritten, the
   tier's blocks loaded into other device blocks (pinned and pageable host memory alike), and the
   KV plane's block reads and writes (`PagedKv.read` / `write`: what P serves, what D writes);
3. measures host<->device bandwidth of the tier's copies for runs of 1, 8, 64 and 256 blocks,
   pinned and pageable, beside the plain `copy_` of as many contiguous bytes (the link's ceiling).

It needs torch alone (the device machine has no vLLM): from the repo's root,

    mkdir -p /tmp/pkg/pdcluster && for d in proto transfer bench; do ln -sfn "$PWD/$d" /tmp/pkg/pdcluster/$d; done
    PYTHONPATH=/tmp/pkg python -m pdcluster.bench.gpu_tier_check --out "$OUT/gpu_tier.json"

(`--device cpu --quick`: the same checks on this machine's CPU, tests/test_gpu_tier_check.py).
The figures go to the parameter files' `host_link` with their source.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pdcluster.transfer.host_tier import HostTier
from pdcluster.transfer.paged_kv import PagedKv

LAYOUTS = {  # name -> one layer's shape for n blocks, in vLLM's GPU layouts (block size 16 and 64)
    "flash_attn": lambda n: (2, n, 16, 8, 128),
    "mla": lambda n: (n, 64, 576),
}
RUNS = (1, 8, 64, 256)


def caches(layout: str, num_blocks: int, layers: int, device: str) -> dict[str, torch.Tensor]:
    shape = LAYOUTS[layout]
    gen = torch.Generator(device="cpu").manual_seed(0)
    return {f"layer.{i}": torch.randn(shape(num_blocks), generator=gen, dtype=torch.float32).to(torch.bfloat16)
            .to(device) for i in range(layers)}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def round_trip(layout: str, device: str, pin: bool, num_blocks: int = 64, layers: int = 4) -> list[str]:
    """What did not come back byte for byte (empty: all did)."""
    kv_caches = caches(layout, num_blocks, layers, device)
    want = {name: t.clone() for name, t in kv_caches.items()}
    kv = PagedKv(kv_caches, dict.fromkeys(kv_caches, 0), num_blocks)
    tier = HostTier(kv, pin=pin)
    src, dst = [3, 7, 8, 20], [40, 41, 50, 63]
    keys = [(0, f"b{b}".encode()) for b in src]
    tier.store(keys, src)
    for t in kv_caches.values():
        t.zero_()
    tier.load(keys, dst)
    sync(device)
    bad = []
    for name, t in kv_caches.items():
        got, ref = kv.view(name), PagedKv({name: want[name]}, {name: 0}, num_blocks).view(name)
        for s, d in zip(src, dst):
            if not torch.equal(got[d].cpu(), ref[s].cpu()):
                bad.append(f"{layout} pin={pin} {name}: block {s} -> {d}")
    # The KV plane's own reads and writes: blocks read from one cache (P), written into another (D).
    other = PagedKv({n: torch.zeros_like(t) for n, t in kv_caches.items()}, dict.fromkeys(kv_caches, 0), num_blocks)
    for name in kv_caches:
        other.write(name, [1, 2, 9], kv.read(name, [40, 41, 50]))
    sync(device)
    for name in kv_caches:
        got, ref = other.view(name), kv.view(name)
        if not (torch.equal(got[1:3].cpu(), ref[40:42].cpu()) and torch.equal(got[9].cpu(), ref[50].cpu())):
            bad.append(f"{layout} {name}: KV plane read/write")
    return bad


def _seconds(fn, device: str, repeat: int) -> float:
    fn()  # warm up (allocations, the first pinned buffer)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def bandwidth(layout: str, device: str, runs: tuple[int, ...], layers: int, repeat: int) -> list[dict]:
    """GB/s of the tier's loads and stores per run length, pinned and pageable, and copy_'s ceiling."""
    num_blocks = max(runs) * 2
    kv = PagedKv(caches(layout, num_blocks, layers, device), {f"layer.{i}": 0 for i in range(layers)}, num_blocks)
    out = []
    for pin in (True, False):
        if pin and not device.startswith("cuda"):
            continue  # pinning needs an accelerator's driver
        tier = HostTier(kv, pin=pin)
        for n in runs:
            keys = [(0, f"{pin}-{n}-{i}".encode()) for i in range(n)]
            tier.store(keys, list(range(n)))
            nbytes = n * tier.block_bytes(0)
            load_s = _seconds(lambda: tier.load(keys, list(range(n, 2 * n))), device, repeat)
            store_s = _seconds(lambda: tier.store(keys, list(range(n))), device, repeat)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ceiling_s = _seconds(lambda: dev.copy_(host, non_blocking=pin), device, repeat)
            out.append({"layout": layout, "pinned": pin, "blocks": n, "bytes": nbytes,
                        "load_GBps": nbytes / load_s / 1e9, "store_GBps": nbytes / store_s / 1e9,
                        "copy_ceiling_GBps": nbytes / ceiling_s / 1e9})
            tier.evict(keys)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="short runs (the harness's own test)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    bad = [b for layout in LAYOUTS for pin in ((True, False) if a.device.startswith("cuda") else (False,))
           for b in round_trip(layout, a.device, pin)]
    runs, layers, repeat = ((1, 8), 2, 2) if a.quick else (RUNS, 8, 10)
    rows = [r for layout in LAYOUTS for r in bandwidth(layout, a.device, runs, layers, repeat)]
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"device: {name}; round trips: {'all exact' if not bad else f'{len(bad)} differ'}")
    for b in bad:
        print("  DIFFERS:", b)
    print(f"{'layout':11} {'pinned':6} {'blocks':>6} {'MiB':>8} {'load GB/s':>10} {'store GB/s':>10} {'copy_ GB/s':>10}")
    for r in rows:
        print(f"{r['layout']:11} {str(r['pinned']):6} {r['blocks']:6} {r['bytes'] / 2**20:8.1f} "
              f"{r['load_GBps']:10.2f} {r['store_GBps']:10.2f} {r['copy_ceiling_GBps']:10.2f}")
    if a.out:
        a.out.write_text(json.dumps({"device": name, "differs": bad, "bandwidth": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
