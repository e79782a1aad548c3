"""Vocabulary of the pet-name model and the cleaning that maps raw text onto it.

The 31-symbol alphabet is that of Saturn Cloud's pet-name tutorial, in the same order, so
indices (and therefore trained weights) stay compatible with it. Index 0 (``*``) pads short
contexts and index 1 (``+``) marks the end of a name; neither may ever appear inside a name.
"""

import unicodedata
from collections.abc import Iterable
from dataclasses import asdict, dataclass

CHARACTERS = "*+abcdefghijklmnopqrstuvwxyz-. "
PAD = "*"
STOP = "+"
CONTEXT_LEN = 8
VOCAB_SIZE = len(CHARACTERS)

_INDEX = {char: i for i, char in enumerate(CHARACTERS)}
# Characters a cleaned name may contain: the vocabulary minus the two control symbols.
NAME_CHARACTERS = frozenset(CHARACTERS) - {PAD, STOP}
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")
_MAX_EXAMPLES = 5


def encode(text: str) -> list[int]:
    """Vocabulary indices of ``text``; raises ValueError on a character outside the vocabulary."""
    try:
        return [_INDEX[char] for char in text]
    except KeyError as err:
        raise ValueError(
            f"character {err.args[0]!r} in {text!r} is not in the vocabulary {CHARACTERS!r}"
        ) from None


def decode(indices: Iterable[int]) -> str:
    """Inverse of :func:`encode` (accepts ints, numpy integers or 0-d tensors)."""
    return "".join(CHARACTERS[int(i)] for i in indices)


def _normalise(raw: str) -> tuple[str, int]:
    """Normalised name plus how many characters had to be dropped as out-of-vocabulary."""
    # casefold (not lower) so e.g. "ß" becomes "ss"; NFKD then splits "é" into "e" + accent
    # and ligatures like "ﬁ" into "fi", and the combining accents are discarded below.
    text = unicodedata.normalize("NFKD", raw.casefold())
    kept: list[str] = []
    dropped = 0
    for char in text:
        if char in NAME_CHARACTERS:
            kept.append(char)
        elif char.isspace():
            kept.append(" ")
        elif not unicodedata.combining(char):
            dropped += 1
    # Collapse whitespace only after dropping, so "a 😀 b" gives "a b", not "a  b".
    name = " ".join("".join(kept).split())
    if not _LETTERS.intersection(name):
        # Pure punctuation such as "--" or "." is not a name worth learning from.
        name = ""
    return name, dropped


def normalise_name(raw: str) -> str:
    """Map raw text onto the vocabulary: fold accents, lowercase, tidy spaces, drop the rest.

    Returns "" when nothing name-like (no letter a-z) is left.
    """
    return _normalise(raw)[0]


@dataclass(frozen=True)
class CleanReport:
    """What :func:`clean_names` did, for logging and run metadata."""

    num_input: int
    num_kept: int
    num_rejected: int  # not a str, or empty after cleaning
    num_chars_dropped: int  # out-of-vocabulary characters removed from kept and rejected names
    examples_rejected: tuple[str, ...]  # reprs of up to 5 rejected inputs

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["examples_rejected"] = list(self.examples_rejected)
        return data


def clean_names(raw: Iterable[object]) -> tuple[list[str], CleanReport]:
    """Normalise every item, keeping order and duplicates; never raises on odd content."""
    kept: list[str] = []
    examples: list[str] = []
    num_input = num_rejected = num_dropped = 0
    for item in raw:
        num_input += 1
        name = ""
        if isinstance(item, str):
            name, dropped = _normalise(item)
            num_dropped += dropped
        if name:
            kept.append(name)
            continue
        num_rejected += 1
        if len(examples) < _MAX_EXAMPLES:
            examples.append(repr(item)[:80])
    report = CleanReport(num_input, len(kept), num_rejected, num_dropped, tuple(examples))
    return kept, report
