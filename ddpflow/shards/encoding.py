"""How a shard holds its records: raw (fixed-size uint8 records, sliced as they are) or jpeg
(each image record compressed on its own, decoded on the rank).

The encoding is a property of a split: its index names it (ddpflow.shards.index), and every
shard it lists is written that way. An index without an encoding field is raw, so indexes
written before there was a choice read as they did. Free of torch: the flow process builds a
format's plan with it and starts without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

EncodingKind = Literal["raw", "jpeg"]
KINDS: tuple[EncodingKind, ...] = ("raw", "jpeg")
# libjpeg's range is 1-100; below 50 the blocks show on 32 px images, and a quality nobody
# would train on is more likely a typo (the flows bound it the same way).
MIN_JPEG_QUALITY, MAX_JPEG_QUALITY = 50, 100
# Measured (bench.shard_encoding, docs/data.md): at 90 a 224 px image takes 0.070x raw's
# bytes (generated shapes with noise), and digits and shapes train to raw shards' accuracy
# within the spread across training seeds.
DEFAULT_JPEG_QUALITY = 90


@dataclass(frozen=True)
class ShardEncoding:
    """`kind` raw or jpeg; `quality` (jpeg's, MIN_JPEG_QUALITY to 100) is ignored for raw."""

    kind: EncodingKind = "raw"
    quality: int = DEFAULT_JPEG_QUALITY

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"shard encoding {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "raw":  # one raw encoding: an index read back equals the one written
            object.__setattr__(self, "quality", DEFAULT_JPEG_QUALITY)
            return
        quality = self.quality
        if isinstance(quality, bool) or not isinstance(quality, int):
            raise ValueError(f"jpeg quality={quality!r} is not a whole number")
        if not MIN_JPEG_QUALITY <= quality <= MAX_JPEG_QUALITY:
            raise ValueError(
                f"jpeg quality={quality} is not from {MIN_JPEG_QUALITY} to {MAX_JPEG_QUALITY}"
            )

    @property
    def raw(self) -> bool:
        return self.kind == "raw"

    def cache_key(self) -> str:
        """What a format's cache keys add for this encoding: nothing for raw (so the keys of
        raw formats are those written before there was a choice), else kind and quality."""
        return "" if self.raw else f"-{self.kind}{self.quality}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "quality": self.quality}

    def __str__(self) -> str:
        return "raw" if self.raw else f"{self.kind} (quality {self.quality})"


RAW = ShardEncoding()
