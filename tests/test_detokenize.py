"""The streaming detokenizer against the whole decode: random token sequences of a real byte-level BPE tokenizer
(the tiny fixture's: byte tokens that are invalid or partial UTF-8, special tokens, ordinary pieces) stream the
exact text of ``tokenizer.decode``, and a long run of invalid UTF-8 costs decoding linear in its length."""

import random

import pytest

from tripath.server.http.detokenize import HOLD, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from server_models import build_tokenizer
    return build_tokenizer()


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE vocabulary."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], shifted = chr(256 + shifted), shifted + 1
    return chars


@pytest.fixture(scope="module")
def byte_ids(tokenizer) -> list[int]:
    """``byte_ids[b]``: the token of the single byte ``b``."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in gpt2_byte_chars().values()]
    assert tokenizer.decode([ids[ord("A")]]) == "A" and tokenizer.decode([ids[0xE2], ids[0x82], ids[0xAC]]) == "€"
    return ids


class CountingTokenizer:
    """Forwards ``decode`` and counts the tokens it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens_decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.tokens_decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def streamed(tokenizer, ids, skip_special_tokens=True) -> str:
    d = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    text = "".join(d.push(t) for t in ids) + d.flush()
    assert text == d.text
    return text


TRICKY_BYTES = [0x80, 0x9F, 0xBF, 0xC3, 0xE2, 0xF0, 0xF4, 0xF8, 0xFF, 0x20, 0x41]   # continuation, lead, never valid


def test_streamed_text_equals_the_whole_decode_on_random_tokens(tokenizer, byte_ids):
    rng = random.Random(51)
    specials = tokenizer.convert_tokens_to_ids(["<s>", "</s>", "<|user|>"])
    pieces = [tokenizer.encode(s) for s in ["é", " 日本", "🙂", " ok", "\u200d"]]
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 60)):
            r = rng.random()
            if r < 0.6:
                ids.append(byte_ids[rng.choice(TRICKY_BYTES)])
            elif r < 0.7:
                ids.append(rng.choice(specials))
            elif r < 0.85:
                ids.extend(rng.choice(pieces))
            else:
                ids.append(rng.randrange(len(tokenizer)))
        for skip in (True, False):
            assert streamed(tokenizer, ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip), (ids, skip)


@pytest.mark.parametrize("run", ["continuation", "mixed"])
def test_a_long_run_of_invalid_utf8_costs_decoding_linear_in_its_length(tokenizer, byte_ids, run):
    rng = random.Random(8)
    n = 8000
    if run == "continuation":
        ids = [byte_ids[0x80]] * n
    else:   # bytes never valid in UTF-8, and characters cut short by one
        chunks = [[0x80], [0xBF], [0xC0], [0xFF], [0xE2, 0x82, 0xFF], [0xF0, 0x9F, 0x99, 0xC1], [0xC3, 0xF8]]
        ids = [byte_ids[b] for _ in range(n // 2) for b in rng.choice(chunks)][:n]
    ids += tokenizer.encode(" done 🙂")
    counting = CountingTokenizer(tokenizer)
    assert streamed(counting, ids) == tokenizer.decode(ids)
    # each token decodes a window of a few tokens (a quadratic detokenizer decodes ~n * n / 2 = 32 million)
    assert counting.tokens_decoded < 100 * len(ids)


def test_pieces_stream_as_soon_as_they_are_final(tokenizer, byte_ids):
    d = IncrementalDetokenizer(tokenizer)
    assert [d.push(byte_ids[b]) for b in (0xF0, 0x9F, 0x99)] == ["", "", ""]   # inside a character
    assert d.push(byte_ids[0x82]) == "🙂"
    invalid = [d.push(byte_ids[0x80]) for _ in range(50)]
    assert set("".join(invalid)) == {"\ufffd"} and len("".join(invalid)) >= 50 - HOLD   # a few held back
    assert "".join(invalid) + d.flush() == "\ufffd" * 50
