"""The router's detokenizer over one long answer: its cost per request, by delta size.

Compares the router's incremental `_Detokenizer` (tokenizers' DecodeStream, a step per
id) with what it replaced, decoding every id so far at each delta, over the same random
ids of the tiny model's vocabulary, in one run. Random ids are a worst case for UTF-8
splits, not for length: the cost of the old way grows with the answer either way.

usage: python -m pdcluster.bench.detokenize [--tokens 1024] [--deltas 1,8] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import time


def redecode_all(tokenizer, ids: list[int], per_delta: int) -> str:
    """The old way: the whole sequence so far, decoded again at each delta."""
    text = ""
    for end in range(per_delta, len(ids) + per_delta, per_delta):
        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
    return text


def incremental(tokenizer, ids: list[int], per_delta: int) -> str:
    from pdcluster.router.text_codec import Detokenizer as _Detokenizer

    detok, text = _Detokenizer(tokenizer), ""
    for start in range(0, len(ids), per_delta):
        text += detok.add(ids[start:start + per_delta])
    return text


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--deltas", default="1,8", help="comma-separated tokens per delta")
    ap.add_argument("--model-dir", default=".pdcluster/models/tiny-qwen3")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest is reported")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    rng = random.Random(0)
    ids = [rng.randrange(3, len(tokenizer)) for _ in range(args.tokens)]
    print("| tokens per delta | re-decode all, ms a request | incremental, ms a request | ratio |")
    print("|---|---|---|---|")
    for per_delta in (int(d) for d in args.deltas.split(",")):
        best = {}
        for way in (redecode_all, incremental):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                text = way(tokenizer, ids, per_delta)
                times.append(time.perf_counter() - t0)
            best[way.__name__] = (min(times) * 1e3, text)
        (old_ms, old_text), (new_ms, new_text) = best["redecode_all"], best["incremental"]
        assert new_text == old_text, "the incremental detokenizer's text differs from a whole decode"
        print(f"| {per_delta} | {old_ms:.1f} | {new_ms:.2f} | {old_ms / new_ms:.0f}x |")


if __name__ == "__main__":
    main()
