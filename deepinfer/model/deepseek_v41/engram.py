"""Engram: DeepSeek-V4.1's n-gram hash memory, gated into the hyper-connection trunk.

Data flow (the first two once, on the CPU, at load time)::

    config.json --EngramArgs.from_dict--> EngramArgs --EngramTables.of--> primes, multipliers,
                                                                          row offsets
    tokenizer ---compressed_vocabulary--> vocab id -> compressed id (and the compressed pad id)
    per forward, on the device:
      compressed ids of the request history --ngram_windows--> windows [T, N]
      windows --ngram_hashes (per Engram layer)--> rows [T, (N-1)*H]
      trunk [T, hc, D] at the start of an Engram layer --Engram(trunk, rows)--> trunk [T, hc, D]

N = max_ngram_size, H = heads per n-gram size, hd = head dim, R = (N-1)*H rows per token,
hc = hyper-connection streams, D = hidden size. A window holds the token's compressed id and the
N-1 before it, newest first: ``windows[t, r]`` is the id r positions back; before the sequence
start, the compressed id of ``pad_token_id``. So a forward needs the N-1 compressed ids before
its first token (fewer at the sequence start).

Each Engram layer owns one table, the R hash tables stacked in hash-column order::

    embed.weight [num_embeddings, hd]
    | 2-gram head 0 | 2-gram head 1 | ... | 3-gram head 0 | ... | N-gram head H-1 |
    ^ offset 0      ^ offset p(2,0)                             num_embeddings = sum of the primes

Column c = (n-2)*H + j of ``ngram_hashes`` is a row in the table of n-gram size n, head j: the
n-gram's hash modulo that table's prime, plus the table's offset. Every table size is a distinct
prime (across all layers too), so no two heads alias the same way.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from deepinfer.model.layers import linear

# The seed the hash multipliers were trained with; each layer draws from seed + 10007 * layer_id.
HASH_SEED = 0
LAYER_SEED_STRIDE = 10007
# Gate: sigmoid(signed sqrt(score)), the square root's argument clamped away from zero.
GATE_CLAMP = 1e-6
FP8_TABLE_BLOCK = 32  # columns sharing one scale in an FP8 table row


@dataclass(frozen=True)
class EngramArgs:
    """The Engram keys of V4.1's text config (``engram_*``).

    ``vocab_size`` (``engram_vocab_size``): the size each hash table's prime is searched from;
    ``compressed_vocab_size``: how many compressed ids the tokenizer's compressed vocabulary has
    (0: no compression, ids are hashed as they are); ``tokenizer_vocab_size`` (``vocab_size``):
    the vocabulary hashed without compression; ``pad_token_id``: the raw id whose compressed id
    fills windows before a sequence's start; ``num_embeddings``: the per-layer table rows the
    config states (checked against the primes; empty: not stated).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int
    compressed_vocab_size: int = 0
    pad_token_id: int = 2
    tokenizer_vocab_size: int = 129280
    num_embeddings: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = self.layer_ids
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(
                f"config: engram_layer_ids={list(ids)} must be distinct layer ids, at least one"
            )
        for key, value, least in (
            ("engram_max_ngram_size", self.max_ngram_size, 2),
            ("engram_n_heads", self.n_heads, 1),
            ("engram_head_dim", self.head_dim, 1),
            ("engram_vocab_size", self.vocab_size, 2),
            ("engram_compressed_vocab_size", self.compressed_vocab_size, 0),
            ("engram_pad_token_id", self.pad_token_id, 0),
            ("vocab_size", self.tokenizer_vocab_size, 1),
        ):
            if value < least:
                raise ValueError(f"config: {key}={value} must be at least {least}")
        if self.num_embeddings:
            tables = EngramTables.of(self)
            if self.num_embeddings != tables.num_embeddings:
                raise ValueError(
                    f"config: engram_num_embeddings={list(self.num_embeddings)}, but the prime "
                    f"tables of layers {list(self.layer_ids)} hold {list(tables.num_embeddings)}"
                )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> EngramArgs | None:
        """The text config's keys (flat); None when ``engram_layer_ids`` is absent or empty."""
        layer_ids = config.get("engram_layer_ids")
        if not layer_ids:
            return None

        def need(key: str) -> int:
            if config.get(key) is None:
                raise ValueError(f"config: {key} is missing (engram_layer_ids={layer_ids})")
            return int(config[key])

        num_embeddings = config.get("engram_num_embeddings") or ()
        if num_embeddings and len(num_embeddings) != len(layer_ids):
            raise ValueError(
                f"config: engram_num_embeddings={list(num_embeddings)} has "
                f"{len(num_embeddings)} entries for engram_layer_ids={list(layer_ids)}"
            )
        return cls(
            layer_ids=tuple(int(i) for i in layer_ids),
            max_ngram_size=need("engram_max_ngram_size"),
            n_heads=need("engram_n_heads"),
            head_dim=need("engram_head_dim"),
            vocab_size=need("engram_vocab_size"),
            compressed_vocab_size=int(config.get("engram_compressed_vocab_size") or 0),
            pad_token_id=need("engram_pad_token_id"),
            tokenizer_vocab_size=int(config.get("vocab_size", 129280)),
            num_embeddings=tuple(int(n) for n in num_embeddings),
        )

    @property
    def num_rows_per_token(self) -> int:
        """R: hash columns per token and layer, (N-1) n-gram sizes times H heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def embed_dim(self) -> int:
        """Width of a token's gathered rows, the input of ``wkv``: R * hd."""
        return self.num_rows_per_token * self.head_dim

    @property
    def hash_vocab_size(self) -> int:
        """The id range the multipliers were drawn for: compressed ids, or raw ones."""
        return self.compressed_vocab_size or self.tokenizer_vocab_size


# Deterministic Miller-Rabin: these bases decide every n below 3.3e24.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    assert n < 3_317_044_064_679_887_385_961_981, f"{n} is past the deterministic bases' range"
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(n: int) -> int:
    """The smallest prime strictly greater than n."""
    n += 1
    while not is_prime(n):
        n += 1
    return n


@dataclass(frozen=True)
class EngramTables:
    """The hash geometry, per Engram layer in ``layer_ids`` order (torch-free, built once).

    ``primes[i]``: the R table sizes in hash-column order; ``offsets[i]``: each table's first
    row in the layer's stacked table; ``multipliers[i]``: N odd int64 multipliers, one per
    look-back r; ``num_embeddings[i]``: the layer's table rows.
    """

    layer_ids: tuple[int, ...]
    n_heads: int
    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]
    num_embeddings: tuple[int, ...]

    @staticmethod
    @functools.cache
    def of(args: EngramArgs, seed: int = HASH_SEED) -> EngramTables:
        primes = _table_primes(args)
        offsets = tuple(tuple(int(o) for o in np.cumsum((0, *p[:-1]))) for p in primes)
        num_embeddings = tuple(sum(p) for p in primes)
        # The rows are int32 on the kernels' side.
        if max(num_embeddings) >= 2**31:
            raise ValueError(
                f"config: engram_vocab_size={args.vocab_size} gives {max(num_embeddings)} table "
                "rows in a layer, more than int32 indexes"
            )
        return EngramTables(
            layer_ids=args.layer_ids,
            n_heads=args.n_heads,
            primes=primes,
            offsets=offsets,
            multipliers=_multipliers(args, seed),
            num_embeddings=num_embeddings,
        )

    def index(self, layer_id: int) -> int:
        assert layer_id in self.layer_ids, f"layer {layer_id} is not one of {self.layer_ids}"
        return self.layer_ids.index(layer_id)


def _table_primes(args: EngramArgs) -> tuple[tuple[int, ...], ...]:
    """Per layer, the R table sizes: each n-gram size's heads take the next primes at or above
    ``vocab_size`` that no earlier layer or head took, in config order (layer, n-gram size,
    head). Changing the order changes every table, so it is the trained one."""
    taken: set[int] = set()
    per_layer = []
    for _ in args.layer_ids:
        sizes = []
        for _ in range(args.max_ngram_size - 1):
            prime = args.vocab_size - 1
            for _ in range(args.n_heads):
                prime = next_prime(prime)
                while prime in taken:
                    prime = next_prime(prime)
                taken.add(prime)
                sizes.append(prime)
        per_layer.append(tuple(sizes))
    return tuple(per_layer)


def _multipliers(args: EngramArgs, seed: int) -> tuple[tuple[int, ...], ...]:
    """Per layer, N odd multipliers below int64 max / hash_vocab_size (so that id * multiplier
    stays in int64 for in-range ids), from NumPy's PCG64 seeded per layer: the trained draws."""
    bound = max(1, (np.iinfo(np.int64).max // args.hash_vocab_size) // 2)
    out = []
    for layer_id in args.layer_ids:
        rng = np.random.default_rng(seed + LAYER_SEED_STRIDE * layer_id)
        draws = rng.integers(0, bound, size=(args.max_ngram_size,), dtype=np.int64) * 2 + 1
        out.append(tuple(int(m) for m in draws))
    return tuple(out)


def compressed_vocabulary(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """Vocab id -> compressed id: ids whose single-token text normalizes alike share one.

    Each id is decoded alone with special tokens kept, then NFKC, NFD, accents stripped,
    lowercased, whitespace runs collapsed to one space and stripped, except that a text that
    is exactly one space stays one space. A text that normalizes to nothing keeps its decoded
    text; a partial UTF-8 piece (decodes to U+FFFD) is keyed by its raw vocabulary spelling, so
    distinct byte pieces stay distinct. Compressed ids count up in order of first appearance.
    Returns (int32 [vocab_size], the number of compressed ids).
    """
    keep_space = "\ue000"  # private-use placeholder that Strip leaves alone
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
            normalizers.Strip(),
            normalizers.Replace(keep_space, " "),
        ]
    )
    ids: dict[str, int] = {}
    table = np.empty(tokenizer.get_vocab_size(), dtype=np.int32)
    for token_id in range(len(table)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
            assert key is not None, f"token {token_id} has no vocabulary spelling"
        else:
            key = normalizer.normalize_str(text) or text
        table[token_id] = ids.setdefault(key, len(ids))
    return table, len(ids)


def vocabulary_of_file(path: Path) -> tuple[np.ndarray, int]:
    """``compressed_vocabulary`` of a tokenizer.json, computed once per file content (decoding
    every id takes seconds; loads and tests reuse it)."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest not in _VOCABULARIES:
        _VOCABULARIES[digest] = compressed_vocabulary(Tokenizer.from_str(data.decode("utf-8")))
    return _VOCABULARIES[digest]


_VOCABULARIES: dict[str, tuple[np.ndarray, int]] = {}  # by the tokenizer.json's sha256


def ngram_windows(
    compressed_ids: torch.Tensor, positions: torch.Tensor, max_ngram_size: int, pad_id: int
) -> torch.Tensor:
    """One sequence's windows: compressed_ids [L] int64 (the sequence through its last
    position), positions [T] int64 -> [T, N] int64, ``[t, r] = compressed_ids[positions[t] -
    r]``, ``pad_id`` (the compressed pad id) where that is before the sequence start."""
    back = torch.arange(max_ngram_size, device=positions.device)
    src = positions.unsqueeze(1) - back  # [T, N]
    ids = compressed_ids[src.clamp_min(0)]  # [T, N]
    return torch.where(src >= 0, ids, torch.full_like(ids, pad_id))


HashParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def hash_params(tables: EngramTables, layer_id: int, device: torch.device | None) -> HashParams:
    """``layer_id``'s (multipliers [N], primes [N-1, H], offsets [N-1, H]) int64 on ``device``:
    built once (a forward captured in a CUDA graph cannot copy them from the host)."""
    i = tables.index(layer_id)
    n = len(tables.multipliers[i])
    mult = torch.tensor(tables.multipliers[i], dtype=torch.int64, device=device)
    primes = torch.tensor(tables.primes[i], dtype=torch.int64, device=device).view(n - 1, -1)
    offsets = torch.tensor(tables.offsets[i], dtype=torch.int64, device=device).view(n - 1, -1)
    return mult, primes, offsets


def ngram_hashes(
    windows: torch.Tensor,
    tables: EngramTables,
    layer_id: int,
    params: HashParams | None = None,
) -> torch.Tensor:
    """windows [T, N] int64 -> rows [T, R] int64 of ``layer_id``'s stacked table (``params``:
    ``hash_params`` on windows' device, built here when not given).

    The n-gram hash is the XOR of ``windows[:, r] * multipliers[r]`` for r < n, in int64 with
    wraparound; column (n-2)*H + j is that hash modulo the table's prime (floor modulo, never
    negative) plus the table's offset. In-range ids never wrap; the wrap and the floor modulo
    only decide what out-of-range ids hash to, and match the reference kernel there too.
    """
    mult, primes, offsets = params or hash_params(tables, layer_id, windows.device)
    n = mult.shape[0]
    assert windows.dim() == 2 and windows.shape[1] == n, f"windows {windows.shape}, N={n}"
    prod = windows.to(torch.int64) * mult  # [T, N]
    mixed = prod[:, 0]
    cols = []
    for r in range(1, n):
        mixed = torch.bitwise_xor(mixed, prod[:, r])  # [T]: the (r+1)-gram's hash
        cols.append(torch.remainder(mixed.unsqueeze(1), primes[r - 1]) + offsets[r - 1])
    return torch.cat(cols, dim=1)  # [T, (N-1)*H]


def engram_gate(
    trunk: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    clamp: float = GATE_CLAMP,
) -> torch.Tensor:
    """trunk [T, hc, D], kv [T, hc+1, D] (a key per stream, then the value) -> [T, hc, D] in
    trunk's dtype; the math in fp32.

    Per stream s: score = <rms(x_s) * q_weight[s], rms(k_s) * k_weight[s]> / sqrt(D),
    gate = sigmoid(sign(score) * sqrt(max(|score|, clamp))), x_s + gate * v. The weights are
    rounded to bf16 before their fp32 product, as the deployed kernel reads them; the sign is
    copysign's (a zero score gates at sigmoid(+sqrt(clamp)), as the kernel does).
    """
    hc, dim = trunk.shape[1], trunk.shape[2]
    x = trunk.float()
    k, v = kv[:, :hc].float(), kv[:, hc:].float()  # [T, hc, D], [T, 1, D]
    w = q_weight.to(torch.bfloat16).float() * k_weight.to(torch.bfloat16).float()  # [hc, D]
    rstd_x = torch.rsqrt(x.square().mean(-1) + eps)  # [T, hc]
    rstd_k = torch.rsqrt(k.square().mean(-1) + eps)  # [T, hc]
    score = (x * w * k).sum(-1) * rstd_x * rstd_k * dim**-0.5  # [T, hc]
    gate = torch.sigmoid(torch.copysign(score.abs().clamp_min(clamp).sqrt(), score))
    return (x + gate.unsqueeze(-1) * v).to(trunk.dtype)


class NgramTable(nn.Module):
    """One layer's stacked hash tables (``engram.embed``): ``weight`` [num_embeddings, hd], in
    the module dtype, or float8_e4m3fn with ``scale`` [num_embeddings, hd/32] fp32 (the
    checkpoint's per-row, per-32-column ue8m0 scales, decoded)."""

    def __init__(self, num_embeddings: int, dim: int, fp8: bool = False) -> None:
        super().__init__()
        self.dim = dim
        dtype = torch.float8_e4m3fn if fp8 else None
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, dtype=dtype), requires_grad=False
        )
        self.scale = None
        if fp8:
            assert dim % FP8_TABLE_BLOCK == 0, f"FP8 table width {dim} is not a multiple of 32"
            scale = torch.ones(num_embeddings, dim // FP8_TABLE_BLOCK, dtype=torch.float32)
            self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [T, R] int64 -> [T, R, hd] in ``dtype`` (FP8 rows dequantized exactly)."""
        if self.scale is None:
            return self.weight[rows].to(dtype)
        q = self.weight[rows].float().unflatten(-1, (-1, FP8_TABLE_BLOCK))  # [T, R, hd/32, 32]
        return (q * self.scale[rows].unsqueeze(-1)).flatten(-2).to(dtype)  # [T, R, hd]


class Engram(nn.Module):
    """One layer's Engram, applied to the trunk x [T, hc, D] at the start of the layer: after
    the previous sub-layer's hyper-connection post (the trunk as the previous layer left it)
    and before the attention's hyper-connection pre.

    Gathers the token's R rows, projects them to hc keys and one value (``wkv``), and adds the
    value to each stream under a sigmoid gate of that stream's normalized key-query score
    (``engram_gate``). Parameters, as the checkpoint names them under ``layers.{L}.engram.``:
    ``q_weight``/``k_weight`` [hc, D] (the query's and key's norm weights), ``embed.weight``
    [num_embeddings, hd], ``wkv.weight`` [(hc+1)*D, R*hd]. Text only: image tokens (whose rows
    the deployed engine marks -1 and whose trunk it leaves as it is) are not handled here.
    """

    def __init__(
        self,
        args: EngramArgs,
        layer_id: int,
        hidden_size: int,
        hc_mult: int,
        eps: float,
        fp8_table: bool = False,
    ) -> None:
        super().__init__()
        self.layer_id, self.hc_mult, self.hidden_size, self.eps = (
            layer_id,
            hc_mult,
            hidden_size,
            eps,
        )
        num_embeddings = EngramTables.of(args).num_embeddings[args.layer_ids.index(layer_id)]
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size))
        self.embed = NgramTable(num_embeddings, args.head_dim, fp8_table)
        self.wkv = linear(args.embed_dim, (hc_mult + 1) * hidden_size)

    def forward(self, trunk: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """trunk [T, hc, D], rows [T, R] int64 (``ngram_hashes``) -> trunk [T, hc, D]."""
        emb = self.embed(rows, trunk.dtype).flatten(1)  # [T, R*hd]
        kv = self.wkv(emb).unflatten(-1, (self.hc_mult + 1, self.hidden_size))  # [T, hc+1, D]
        return engram_gate(trunk, kv, self.q_weight, self.k_weight, self.eps)
