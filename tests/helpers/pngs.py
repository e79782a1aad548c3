"""Tiny PNG files for image-folder tests (unit and integration)."""

from __future__ import annotations

import io

from PIL import Image


def png(value: int = 128, size: tuple[int, int] = (6, 4), mode: str = "L") -> bytes:
    """A PNG of one colour: `value` is the grey level (or a tuple for RGB)."""
    buffer = io.BytesIO()
    Image.new(mode, size, value).save(buffer, format="PNG")
    return buffer.getvalue()
