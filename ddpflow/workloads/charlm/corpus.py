"""Loading the names corpus (a JSON list of strings) and splitting off a fixed holdout set."""

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from ddpflow.storage.capped_read import ReadRefused, TooLarge, read_capped
from ddpflow.storage.redact import redact_text
from ddpflow.workloads.charlm.vocab import CleanReport, clean_names

DEFAULT_CORPUS_PATH = Path(__file__).parent / "data" / "census_names.json"
# A names corpus is a few MB (the shipped one is under 1 MB); a source far larger is a
# wrong URL or a hostile server, and would be held in memory whole.
MAX_SOURCE_BYTES = 100 * 2**20

_EXPECTED = 'expected a JSON list of name strings, e.g. ["bella", "max"]'
_JSON_TYPES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


class CorpusError(ValueError):
    """The corpus cannot be used; the message names its source and what was expected.

    The message is redacted when the error is made, so no URL credential in it reaches a
    log, a terminal or a Prefect state, whoever raises it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(message))


def source_too_large(source: str, size: int, max_bytes: int = MAX_SOURCE_BYTES) -> CorpusError:
    """The error for a source over the cap; `source` must already be redacted."""
    return CorpusError(
        f"{source}: {size if size > max_bytes + 1 else 'more than ' + str(max_bytes)} bytes, "
        f"over the {max_bytes // 2**20} MiB cap on a corpus source; pass a smaller JSON list "
        "of names (deduplicate it or sample from it)"
    )


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def parse_names(data: bytes, source: str) -> tuple[list[str], CleanReport]:
    """Decode, parse, validate and clean a JSON corpus; ``source`` is used in error messages."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(f"{source}: not valid UTF-8 ({err}); {_EXPECTED}") from err
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{source}: not valid JSON ({err}); {_EXPECTED}") from err
    if not isinstance(raw, list):
        raise CorpusError(f"{source}: top level is {_json_type(raw)}; {_EXPECTED}")
    for index, item in enumerate(raw):
        if not isinstance(item, str):
            raise CorpusError(
                f"{source}: item {index} is {_json_type(item)} ({item!r:.60}), "
                f"not a string; {_EXPECTED}"
            )
    names, report = clean_names(raw)
    if not names:
        raise CorpusError(
            f"{source}: no usable names after cleaning ({report.num_input} items, all empty or "
            f"without a letter a-z once accents were folded and other characters dropped, "
            f"e.g. {list(report.examples_rejected)}); {_EXPECTED}"
        )
    return names, report


def load_names(path: str | Path = DEFAULT_CORPUS_PATH) -> tuple[list[str], CleanReport]:
    """:func:`parse_names` on a local file (the shipped stand-in corpus by default)."""
    path = Path(path)
    try:  # a regular file, capped and in time: a FIFO or /dev/zero must fail, not hang
        data = read_capped(LocalFileSystem(), str(path), str(path), MAX_SOURCE_BYTES, _EXPECTED)
    except TooLarge as large:
        raise source_too_large(str(path), large.size) from None
    except ReadRefused as refused:
        raise CorpusError(str(refused)) from None
    except OSError as err:
        raise CorpusError(f"{path}: cannot read corpus ({err}); {_EXPECTED}") from err
    return parse_names(data, str(path))


def _in_holdout(name: str, holdout_fraction: float) -> bool:
    # crc32 rather than hash(): str hashing is salted per process, crc32 is stable forever,
    # so the holdout set is identical for every run, seed and machine.
    return zlib.crc32(name.encode("utf-8")) < holdout_fraction * 2**32


def split_holdout(names: Sequence[str], holdout_fraction: float) -> tuple[list[str], list[str]]:
    """``(train, holdout)`` split by unique name, order kept; duplicates always stay together.

    About ``holdout_fraction`` of the *unique* names go to holdout; because common names repeat,
    the fraction of rows can differ somewhat.
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(
            f"holdout_fraction must be strictly between 0 and 1, got {holdout_fraction!r}"
        )
    decided = {name: _in_holdout(name, holdout_fraction) for name in set(names)}
    train = [name for name in names if not decided[name]]
    holdout = [name for name in names if decided[name]]
    if not train or not holdout:
        empty = "holdout" if not holdout else "training"
        raise CorpusError(
            f"corpus too small to split: {len(decided)} unique names with "
            f"holdout_fraction={holdout_fraction} leave the {empty} set empty; "
            f"use more distinct names or another holdout_fraction"
        )
    return train, holdout
