"""Time to first token for a long prompt, cold vs served mostly from the prefix cache.

    python benchmarks/prefix_ttft.py [--prompt-len 16384] [--cached 0.95] [--threads 2]
    python benchmarks/prefix_ttft.py --device cuda --v4-flash   # 2 V4-Flash-shaped layers
                                                                # (CSA + HCA), random bf16

Three runs of the same second prompt, which shares the first ``cached`` fraction of its tokens
with an earlier one: cold (prefix caching off), warm from the device tier, warm from the disk
tier (the device pool forced to evict the earlier prompt, the host tier off). TTFT = wall time
of a 1-token generate, median of --repeats. Prints the cached/cold ratio of each.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import ensure_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import write_config

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 128000) for _ in range(n)]


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], ONE, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=16384)
    ap.add_argument("--cached", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--v4-flash", action="store_true", help="2 V4-Flash-shaped layers, random")
    ap.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    extra = {}
    if ns.v4_flash:
        folder = write_config(
            tempfile.mkdtemp(), ["compressed_sparse_attention", "heavily_compressed_attention"]
        )
        extra = {"random_weights": True, "max_num_seqs": 4}
    else:
        folder = ensure_tiny_model(0)
    rng = random.Random(0)
    n_shared = int(ns.prompt_len * ns.cached)
    shared = [0, *_ids(rng, n_shared - 1)]
    max_len = ns.prompt_len + 16
    common = dict(
        model=folder,
        device=ns.device,
        max_model_len=max_len,
        max_num_batched_tokens=ns.chunk,
        **extra,
    )

    def second(i: int) -> list[int]:
        return shared + _ids(random.Random(100 + i), ns.prompt_len - n_shared)

    cold = LLM(enable_prefix_caching=False, **common)
    _ttft(cold, second(99))  # warm-up
    cold_s = statistics.median(_ttft(cold, second(i)) for i in range(ns.repeats))
    print(f"cold        {ns.prompt_len} tokens: TTFT {cold_s * 1000:8.1f} ms")
    del cold
    _release()  # one engine's weights and KV cache at a time

    warm = LLM(**common)
    _ttft(warm, [*shared, 5])
    device_s = statistics.median(_ttft(warm, second(i)) for i in range(ns.repeats))
    print(
        f"device tier {ns.cached:.0%} cached: TTFT {device_s * 1000:8.1f} ms, "
        f"cached/cold = {device_s / cold_s:.3f}"
    )
    del warm
    _release()

    blocks = -(-max_len // 128)
    with tempfile.TemporaryDirectory() as tmp:
        disk = LLM(num_blocks=blocks, host_tier_gib=0, disk_tier_dir=tmp, **common)
        times = []
        for i in range(ns.repeats):
            _ttft(disk, [*shared, 5])
            _ttft(disk, _ids(random.Random(200 + i), ns.prompt_len))  # evicts every block
            disk.engine.tiers.flush()
            times.append(_ttft(disk, second(i)))
        disk_s = statistics.median(times)
        hits = dict(disk.engine.scheduler.prefix.stats.cached_tokens_by_tier)
    print(
        f"disk tier   {ns.cached:.0%} cached: TTFT {disk_s * 1000:8.1f} ms, "
        f"cached/cold = {disk_s / cold_s:.3f} (cached tokens by tier: {hits})"
    )


if __name__ == "__main__":
    main()
