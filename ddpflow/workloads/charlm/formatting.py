"""Turn cleaned names into training windows for the next-character model.

Saturn Cloud's pet-name tutorial expanded every name into all its prefixes (plus the stop
symbol), left-padded each prefix to 9 characters with ``*`` and one-hot encoded it as float32:
31 * 8 * 4 bytes of x and 8 * 8 bytes of y per sample, built in Python loops. Here one uint8
row of 9 indices per sample (9 bytes) is built with numpy; x/y are views of it and one-hot
happens per batch.

For a name ``s`` let ``padded = "*" * 8 + s + "+"``; the window of prefix ``j``
(1 <= j <= len(s) + 1) is ``padded[j - 1 : j + 8]``, which equals the tutorial's "last 9 chars
of the prefix, left-padded with *".
"""

from collections.abc import Sequence

import numpy as np
import torch

from ddpflow.workloads.charlm.vocab import (
    CHARACTERS,
    CONTEXT_LEN,
    NAME_CHARACTERS,
    PAD,
    STOP,
    VOCAB_SIZE,
)

WINDOW_LEN = CONTEXT_LEN + 1
_INVALID = 255
# Byte -> vocabulary index; anything a normalised name cannot contain maps to _INVALID.
_LOOKUP = np.full(256, _INVALID, dtype=np.uint8)
for _i, _char in enumerate(CHARACTERS):
    if _char in NAME_CHARACTERS:
        _LOOKUP[ord(_char)] = _i


def _encode_concatenated(names: Sequence[str], lengths: np.ndarray) -> np.ndarray:
    """Vocabulary indices of all names joined together, validated in one vectorised pass."""
    # errors="replace" keeps one byte per character, so offsets still line up with `lengths`.
    raw = np.frombuffer("".join(names).encode("ascii", errors="replace"), dtype=np.uint8)
    codes = _LOOKUP[raw]
    bad = np.flatnonzero(codes == _INVALID)
    if bad.size:
        which = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise ValueError(
            f"name {which} ({names[which]!r}) is not normalised: character "
            f"{names[which][bad[0] - int(lengths[:which].sum())]!r} is outside "
            f"the name alphabet; run vocab.clean_names first"
        )
    return codes


def format_names(names: Sequence[str]) -> torch.Tensor:
    """uint8 windows ``[num_samples, 9]``: one per prefix, name by name, in the tutorial's order.

    Names must already be normalised (see ``vocab.clean_names``); an empty name yields the
    single window ``"********+"``, as in the tutorial.
    """
    if len(names) == 0:
        return torch.empty((0, WINDOW_LEN), dtype=torch.uint8)
    lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
    codes = _encode_concatenated(names, lengths)
    # Lay every name out as padded = 8 pads + name + stop, back to back in one buffer.
    seg_len = lengths + WINDOW_LEN
    seg_start = np.cumsum(seg_len) - seg_len
    buf = np.full(int(seg_len.sum()), CHARACTERS.index(PAD), dtype=np.uint8)
    name_start = np.cumsum(lengths) - lengths
    char_pos = np.arange(codes.size) + np.repeat(seg_start + CONTEXT_LEN - name_start, lengths)
    buf[char_pos] = codes
    buf[seg_start + CONTEXT_LEN + lengths] = CHARACTERS.index(STOP)
    # Window j of a name starts at offset j - 1 of its segment, for j = 1 .. len + 1.
    num_windows = lengths + 1
    starts = np.arange(int(num_windows.sum())) + np.repeat(
        seg_start - (np.cumsum(num_windows) - num_windows), num_windows
    )
    windows = np.lib.stride_tricks.sliding_window_view(buf, WINDOW_LEN)[starts]
    return torch.from_numpy(windows)


def split_xy(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` as int64: the 8 context characters and the 8 next characters (shifted by 1)."""
    windows = windows.long()
    return windows[:, :CONTEXT_LEN], windows[:, 1:]


def one_hot(x: torch.Tensor) -> torch.Tensor:
    """float32 one-hot of index tensor ``x`` (any integer dtype); done per batch by the trainer."""
    return torch.nn.functional.one_hot(x.long(), num_classes=VOCAB_SIZE).float()
