"""The vision tower's encode throughput on DeepSeek-V4.1-Flash shapes: images/s and its FLOP rate.

    bash scripts/gpu_bench.sh benchmarks/image_encode.py [--batch 1,8] [--repeats 10]
    python3 -P benchmarks/image_encode.py --tiny   # CPU smoke test: the tiny tower, 644x490

Shapes: ``VisionArgs()``'s (the release's tower: ViT of 1024 wide, 32 blocks, 16 heads, SwiGLU
2.7x rounded to 128; patch 14, 3x3 downsample) and a projector to the V4.1-Flash hidden size
4096; random weights in bf16 (--tiny: the built-in tiny V4.1's tower, fp32). Images as
deepseek-recipe preprocesses them: 644x490 (a 640x480 photo, 206 positions) and 1848x924
(2000x1000, 992 positions). What is timed: ``ImageEncoder.forward`` on a batch of one size
(pixels on the device already), as the engine's embeddings cache calls it for the images a step
misses; CUDA events (the host clock on the CPU), median of --repeats after --warmup.

FLOPs per image = 2 x (per patch and block: 4 Dv^2 + 3 Dv H; the patch embedding 3 p^2 Dv; the
projector's 9 Dv x D + D^2 per token) + per block 4 N^2 Dv (scores and values, each image's N
patches attending to themselves). Against the H200's dense bf16 peak, 989 TFLOP/s (H200.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from deepinfer.model.deepseek_v41.tiny import tiny_config
from deepinfer.model.deepseek_v41.vision import ImageEncoder
from deepinfer.model.deepseek_v41.vision_args import ImageGrid, VisionArgs

PEAK_BF16 = 989e12
SIZES = ((644, 490), (1848, 924))


def flops(args: VisionArgs, hidden: int, grid: ImageGrid) -> float:
    d, h, n = args.hidden_size, args.mlp_hidden, grid.num_patches
    per_patch = args.depth * (4 * d * d + 3 * d * h) + args.patch_dim * d
    tokens = grid.tokens_w * grid.tokens_h
    projector = tokens * (args.downsample_ratio**2 * d * hidden + hidden * hidden)
    return 2.0 * (n * per_patch + projector) + args.depth * 4.0 * n * n * d


def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.tiny else "cpu")
    if opts.tiny:
        args, hidden, dtype = (
            VisionArgs.from_dict(tiny_config()["vision_config"]),
            64,
            torch.float32,
        )
        opts.repeats, opts.warmup = 2, 1
    else:
        args, hidden, dtype = VisionArgs(), 4096, torch.bfloat16
    assert args is not None
    torch.manual_seed(0)
    encoder = ImageEncoder(args, hidden).to(device=device, dtype=dtype)
    for p in encoder.parameters():
        torch.nn.init.normal_(p, std=0.02)
    print(
        f"vision tower: Dv={args.hidden_size}, depth {args.depth}, heads {args.num_heads}, "
        f"MLP {args.mlp_hidden}, projector to {hidden}, {dtype}, {device}"
    )
    print("| image (px) | positions | patches | batch | ms | images/s | TFLOP/s | of bf16 peak |")
    print("|---|---|---|---|---|---|---|---|")
    for width, height in SIZES[:1] if opts.tiny else SIZES:
        grid = args.grid(width, height)
        for batch in (int(b) for b in opts.batch.split(",")):
            pixels = [
                torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, device=device)
                for _ in range(batch)
            ]
            grids = [grid] * batch
            ms = time_ms(partial(encoder, pixels, grids), device, opts.warmup, opts.repeats)
            rate = batch * flops(args, hidden, grid) / (ms / 1e3)
            print(
                f"| {width}x{height} | {grid.num_tokens} | {grid.num_patches} | {batch} | "
                f"{ms:.2f} | {batch / (ms / 1e3):.1f} | {rate / 1e12:.1f} | "
                f"{rate / PEAK_BF16:.1%} |"
            )


if __name__ == "__main__":
    main()
