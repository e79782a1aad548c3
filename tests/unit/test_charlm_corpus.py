"""Cleaning, corpus parsing, the holdout split and the shipped stand-in corpus."""

import json

import pytest

from ddpflow.workloads.charlm.corpus import (
    DEFAULT_CORPUS_PATH,
    CorpusError,
    load_names,
    parse_names,
    split_holdout,
)
from ddpflow.workloads.charlm.vocab import CHARACTERS, clean_names, decode, encode, normalise_name

SOURCE = "s3://bucket/pets.json"


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return load_names()[0]


# --- normalisation and cleaning -------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Zoë", "zoe"),
        ("José", "jose"),
        ("Ñandú", "nandu"),
        ("  Mr.   Whiskers\t", "mr. whiskers"),
        ("Jean-Luc", "jean-luc"),
        ("r2d2", "rd"),
        ("Bella 🐶", "bella"),
        ("a 😀 b", "a b"),
        ("max*", "max"),
        ("+rex+", "rex"),
        ("*+*", ""),
        ("Straße", "strasse"),
        ("ﬁdo", "fido"),
        ("", ""),
        ("   \n\t ", ""),
        ("🐶🐱", ""),
        ("小白", ""),
        ("--..", ""),
        ("123", ""),
    ],
)
def test_normalise_name(raw: str, expected: str) -> None:
    assert normalise_name(raw) == expected


def test_normalised_names_stay_inside_the_name_alphabet() -> None:
    fraktur_fred = "\U0001d523\U0001d52f\U0001d522\U0001d521"
    weird = f"Ĳsbrand ǅemal Ωmega Ærø ŁÓDŹ 🎉 \u200b\u00a0naïve café\u2010crème {fraktur_fred}"
    name = normalise_name(weird)
    assert name and set(name) <= set(CHARACTERS) - {"*", "+"}
    assert name == name.strip() and "  " not in name


def test_clean_names_counts_and_keeps_order_and_duplicates() -> None:
    raw = ["Bella", "", "Zoë", "   ", None, "max", "小白", "bella", 42, "r2d2", "🐶"]
    names, report = clean_names(raw)
    assert names == ["bella", "zoe", "max", "bella", "rd"]
    assert report.num_input == 11 and report.num_kept == 5 and report.num_rejected == 6
    # 2 CJK chars + 2 digits + 1 emoji dropped; the accent on ë is folded, not dropped.
    assert report.num_chars_dropped == 5
    assert report.examples_rejected == ("''", "'   '", "None", "'小白'", "42")
    as_dict = report.as_dict()
    assert as_dict["num_rejected"] == 6 and as_dict["examples_rejected"][0] == "''"
    json.dumps(as_dict)


def test_encode_decode_roundtrip() -> None:
    assert decode(encode("*mr. whiskers+")) == "*mr. whiskers+"
    assert encode("*+a") == [0, 1, 2]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        encode("Bella")


# --- parse_names ----------------------------------------------------------------------------


def test_parse_names_cleans_and_reports() -> None:
    names, report = parse_names(json.dumps(["Bella", "Zoë", "", "r2d2"]).encode(), SOURCE)
    assert names == ["bella", "zoe", "rd"]
    assert report.num_rejected == 1


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (b'["bella", "max"', "not valid JSON"),
        (b'{"names": ["bella"]}', "top level is an object"),
        (b'"bella"', "top level is a string"),
        (b'["bella", "max", 3, null]', "item 2 is a number"),
        (b'["bella", ["max"]]', "item 1 is a list"),
        (b'["", "  ", "\\ud83d\\udc36", "123"]', "no usable names after cleaning"),
        (b"[]", "no usable names after cleaning"),
        (b'["bella", "\xff\xfe"]', "not valid UTF-8"),
    ],
)
def test_parse_names_errors_name_the_source(data: bytes, pattern: str) -> None:
    with pytest.raises(CorpusError, match=pattern) as info:
        parse_names(data, SOURCE)
    message = str(info.value)
    assert message.startswith(SOURCE + ":")
    assert "expected a JSON list of name strings" in message
    assert isinstance(info.value, ValueError)


def test_load_names_missing_file(tmp_path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(CorpusError, match="cannot read corpus") as info:
        load_names(missing)
    assert str(missing) in str(info.value)


# --- split_holdout --------------------------------------------------------------------------


def test_split_holdout_is_deterministic_disjoint_and_complete(corpus: list[str]) -> None:
    train, holdout = split_holdout(corpus, 0.1)
    assert (train, holdout) == split_holdout(list(corpus), 0.1)
    assert not set(train) & set(holdout)
    assert sorted(train + holdout) == sorted(corpus)
    # Order is preserved within each side.
    held = set(holdout)
    assert train == [n for n in corpus if n not in held]
    assert holdout == [n for n in corpus if n in held]


def test_split_holdout_keeps_duplicates_together() -> None:
    names = ["bella", "max", "bella", "luna", "max", "bella"] * 50
    names += [chr(97 + i % 26) * (1 + i // 26) for i in range(200)]
    train, holdout = split_holdout(names, 0.3)
    for name in set(names):
        side = train if name in train else holdout
        assert side.count(name) == names.count(name)


def test_split_holdout_does_not_depend_on_order_or_other_names(corpus: list[str]) -> None:
    _, holdout = split_holdout(corpus, 0.1)
    _, holdout_reversed = split_holdout(corpus[::-1], 0.1)
    _, holdout_half = split_holdout(corpus[: len(corpus) // 2], 0.1)
    assert set(holdout_reversed) == set(holdout)
    assert set(holdout_half) <= set(holdout)


def test_split_holdout_fraction_on_shipped_corpus(corpus: list[str]) -> None:
    _, holdout = split_holdout(corpus, 0.1)
    unique_fraction = len(set(holdout)) / len(set(corpus))
    row_fraction = len(holdout) / len(corpus)
    assert abs(unique_fraction - 0.1) < 0.02
    assert abs(row_fraction - 0.1) < 0.02


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_split_holdout_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="holdout_fraction"):
        split_holdout(["bella", "max"], fraction)


def test_split_holdout_too_small_corpus() -> None:
    with pytest.raises(CorpusError, match="too small"):
        split_holdout(["bella"] * 100, 0.1)


# --- the shipped stand-in corpus ------------------------------------------------------------


def test_shipped_corpus(corpus: list[str]) -> None:
    raw = json.loads(DEFAULT_CORPUS_PATH.read_text(encoding="utf-8"))
    assert len(raw) >= 40_000
    assert raw == corpus, "shipped corpus should need no cleaning"
    assert all(name == name.lower() and name for name in raw)
    assert set("".join(raw)) <= set(CHARACTERS) - {"*", "+"}
    assert len(set(raw)) < len(raw), "duplicates are expected, as on pet licences"
    assert DEFAULT_CORPUS_PATH.stat().st_size < 1_000_000
