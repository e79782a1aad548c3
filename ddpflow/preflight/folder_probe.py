"""A shared-folder probe that Dask workers run during pre-flight (standard library only, so
a fresh worker does not import torch first)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


def probe_folder(path: str) -> str | None:
    """None if `path`, or the folder it would be created in, is a writable folder here."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return None
    return f"{existing} is not a writable folder on this host"


async def probe_folder_off_loop(path: str) -> str | None:
    """probe_folder in a thread: a hung network mount must not stall the worker's loop."""
    return await asyncio.to_thread(probe_folder, path)
