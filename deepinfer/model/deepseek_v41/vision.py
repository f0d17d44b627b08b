"""DeepSeek-V4.1's vision tower: preprocessed RGB pixels -> the embeddings of an image's prompt
positions (geometry: ``vision_args.py``).

    pixels [h, w, 3] uint8 --patches--> [N, 3 * p * p]  normalized (x / 255 - 0.5) / 0.5, CHW
                                        per patch, patches in row-major grid order
    patches of several images --ViT--> features [sum N, Dv]   pre-norm blocks; attention
                                        within each image only, 2-D rotary (row, column)
    features of one image --downsample--> [tokens_h * tokens_w, Dv * r * r]   each r x r square
                                        (zero-padded at ragged edges), channel-major
    --projector (linear, GELU, linear)--> [tokens_h * tokens_w, D]
    --layout--> [num_tokens, D]: image_start, each row of tokens then image_newline, image_end

Parameters, as the release names them: ``vision.patch_embed.proj``, ``vision.blocks.{i}.``
(``norm1``, ``attn.wqkv``, ``attn.wo``, ``norm2``, ``mlp.w1`` = [gate; up], ``mlp.w2``),
``vision.norm``, ``aligner.w1``, ``aligner.w2``, and ``image_start`` / ``image_end`` /
``image_newline`` [D]. The rotary tables use half the head for rows and half for columns: a
patch at (row, column) rotates head dims [0, hd/4) and [hd/2, 3hd/4) by row angles and the other
quarter pairs by column angles (rotate-half form).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model.deepseek_v41.vision_args import ImageGrid, VisionArgs
from deepinfer.model.layers import RMSNorm
from deepinfer.ops import reference_kernels
from deepinfer.ops.norm import NormBackend

# The normalization of the release's processor (mean = std = 0.5 on every channel).
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5


def image_patches(pixels: torch.Tensor, grid: ImageGrid, patch_size: int) -> torch.Tensor:
    """pixels [grid_h * p, grid_w * p, 3] uint8 -> [grid_h * grid_w, 3 * p * p] float32."""
    p = patch_size
    h, w = grid.grid_h * p, grid.grid_w * p
    if tuple(pixels.shape) != (h, w, 3):
        raise ValueError(f"image pixels {tuple(pixels.shape)} do not fill a {w}x{h} grid")
    x = (pixels.float() / 255.0 - PIXEL_MEAN) / PIXEL_STD  # [h, w, 3]
    x = x.view(grid.grid_h, p, grid.grid_w, p, 3).permute(0, 2, 4, 1, 3)  # [gh, gw, 3, p, p]
    return x.reshape(grid.num_patches, 3 * p * p)


class _PatchEmbed(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.proj = nn.Linear(args.patch_dim, args.hidden_size)


class _Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.wqkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.wo = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for a, b in itertools.pairwise(bounds):  # each image attends to itself
            # [1, H, N, hd]: 4-D inputs take the fused (flash) kernels on CUDA; 3-D ones fall
            # back to the math path, which materializes the N x N scores of every head.
            heads = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*heads)[0].transpose(0, 1)
        return self.wo(out.reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary: x [N, H, hd], cos / sin [N, hd / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class _SwiGLU(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, 2 * args.mlp_hidden, bias=False)  # [gate; up]
        self.w2 = nn.Linear(args.mlp_hidden, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class _Block(nn.Module):
    def __init__(self, args: VisionArgs, norm: NormBackend) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, args.norm_eps, norm)
        self.attn = _Attention(args)
        self.norm2 = RMSNorm(args.hidden_size, args.norm_eps, norm)
        self.mlp = _SwiGLU(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs, norm: NormBackend) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = _PatchEmbed(args)
        self.blocks = nn.ModuleList(_Block(args, norm) for _ in range(args.depth))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps, norm)

    def rotary(self, grids: list[ImageGrid], device: torch.device) -> tuple[torch.Tensor, ...]:
        """cos, sin [sum N, hd / 2]: per patch, its row angles then its column angles."""
        quarter = self.args.head_dim // 4
        inv_freq = 1.0 / self.args.rope_theta ** (
            torch.arange(quarter, dtype=torch.float32, device=device) / quarter
        )
        rows, cols = [], []
        for g in grids:
            r = torch.arange(g.grid_h, device=device, dtype=torch.float32)
            c = torch.arange(g.grid_w, device=device, dtype=torch.float32)
            rows.append(r.repeat_interleave(g.grid_w))
            cols.append(c.repeat(g.grid_h))
        angles = torch.cat(
            [torch.outer(torch.cat(rows), inv_freq), torch.outer(torch.cat(cols), inv_freq)], -1
        )
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, grids: list[ImageGrid]) -> torch.Tensor:
        """patches [sum N, 3 p p] (images in order) -> features [sum N, Dv]."""
        bounds = [0]
        for g in grids:
            bounds.append(bounds[-1] + g.num_patches)
        assert bounds[-1] == patches.shape[0], f"{bounds[-1]} patches, got {patches.shape[0]}"
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(patches.to(weight.dtype))
        cos, sin = self.rotary(grids, patches.device)
        for block in self.blocks:
            x = block(x, cos, sin, bounds)
        return self.norm(x)


def downsample(features: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
    """One image's features [grid_h * grid_w, Dv] -> [tokens_h * tokens_w, Dv * r * r]: each
    r x r square of the grid (rows, then columns; the last ones zero-padded) concatenated
    channel-major (feature c of square position (i, j) at c * r * r + i * r + j)."""
    r, dim = grid.ratio, features.shape[-1]
    x = features.view(grid.grid_h, grid.grid_w, dim)
    x = F.pad(x, (0, 0, 0, grid.tokens_w * r - grid.grid_w, 0, grid.tokens_h * r - grid.grid_h))
    x = x.view(grid.tokens_h, r, grid.tokens_w, r, dim).permute(0, 2, 4, 1, 3)
    return x.reshape(grid.tokens_h * grid.tokens_w, dim * r * r)


class _Projector(nn.Module):
    def __init__(self, args: VisionArgs, hidden_size: int) -> None:
        super().__init__()
        r = args.downsample_ratio
        self.w1 = nn.Linear(args.hidden_size * r * r, hidden_size)
        self.w2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class ImageEncoder(nn.Module):
    """The tower and the image marker embeddings; its parameter names are the release's.
    ``norm``: the norm backend (the model's; None: the torch reference)."""

    def __init__(self, args: VisionArgs, hidden_size: int, norm: NormBackend | None = None) -> None:
        super().__init__()
        self.args = args
        self.vision = VisionTransformer(args, norm or reference_kernels().norm)
        self.aligner = _Projector(args, hidden_size)
        self.image_start = nn.Parameter(torch.zeros(hidden_size))
        self.image_end = nn.Parameter(torch.zeros(hidden_size))
        self.image_newline = nn.Parameter(torch.zeros(hidden_size))

    @torch.inference_mode()
    def forward(self, pixels: list[torch.Tensor], grids: list[ImageGrid]) -> list[torch.Tensor]:
        """Images (uint8 [h, w, 3], on this module's device) -> each image's embeddings
        [num_tokens, D], one per prompt position of the image. The images run through the
        ViT together; each attends only to itself, so an image's embeddings do not depend on
        the others in the batch."""
        p = self.args.patch_size
        patches = torch.cat([image_patches(x, g, p) for x, g in zip(pixels, grids, strict=True)])
        features = self.vision(patches, grids)
        out, start = [], 0
        for g in grids:
            rows = self.aligner(downsample(features[start : start + g.num_patches], g))
            start += g.num_patches
            out.append(self.layout(rows, g))
        return out

    def layout(self, rows: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        """[tokens_h * tokens_w, D] -> [num_tokens, D]: start, rows each ending in a newline,
        end."""
        dim = rows.shape[-1]
        newline = self.image_newline.to(rows.dtype).expand(grid.tokens_h, 1, dim)
        body = torch.cat([rows.view(grid.tokens_h, grid.tokens_w, dim), newline], dim=1)
        ends = [self.image_start.to(rows.dtype)[None], self.image_end.to(rows.dtype)[None]]
        return torch.cat([ends[0], body.reshape(-1, dim), ends[1]])
