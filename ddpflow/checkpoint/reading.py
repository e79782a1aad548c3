"""Reading a checkpoint outside training: `ddpflow.load_checkpoint`.

A training's checkpoints are the stable format of ddpflow.checkpoint.store (version
FORMAT_VERSION): a folder of `epoch-NNNN[.step-NNNNNNNN].pt` files, each a torch.save'd dict
of tensors and plain values, and `latest.json` naming the newest complete one. This reads
one with `weights_only=True` (no code from the file runs) onto the CPU, for evaluation,
export, or a training of your own that starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpflow import storage
from ddpflow.checkpoint.steps import EpochPosition
from ddpflow.checkpoint.store import (
    FORMAT_VERSION,
    POINTER_NAME,
    STATE_SUFFIX,
    Stateful,
    info_values,
    read_pointer,
    saved_names,
    unwrap,
)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What a checkpoint held, besides the objects loaded from it."""

    uri: str  # the checkpoint file read
    step: int  # the `step` given to save_checkpoint (epochs done, for the built-in workloads)
    names: list[str]  # the objects it holds (model, optimizer, ...)
    position: EpochPosition | None = None  # inside an epoch (None: at an epoch's end)
    info: dict[str, Any] = field(default_factory=dict)  # save_checkpoint's plain `info`
    format_version: int = FORMAT_VERSION


def load_checkpoint(uri: str, **objects: Stateful) -> LoadedCheckpoint:
    """Load a checkpoint into `objects` (e.g. `model=net, optimizer=opt`), each from its
    `<name>_state`; any subset of the names the checkpoint holds.

    `uri`: a checkpoint file, or a training's `checkpoint_dir` (local or `s3://`), whose
    `latest.json` names the newest complete checkpoint.
    """
    file_uri = _checkpoint_file(uri)
    state = storage.load_torch(file_uri, "pass a checkpoint file or folder written by ddpflow")
    names = saved_names(state) if isinstance(state, dict) else []
    if not names or "epoch" not in state:
        raise ValueError(
            f"{file_uri} is not a ddpflow checkpoint (no '<name>_state' entries and 'epoch'): "
            "pass a file or folder written by TrainContext.save_checkpoint()"
        )
    version = int(state.get("format_version", 1))
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{file_uri} has checkpoint format {version}; this ddpflow reads up to "
            f"{FORMAT_VERSION}: upgrade ddpflow to read it"
        )
    unknown = sorted(set(objects) - set(names))
    if unknown:
        raise ValueError(
            f"load_checkpoint() got {unknown}, which {file_uri} does not hold (it holds "
            f"{names}): pass only those names"
        )
    for name, obj in objects.items():
        unwrap(obj).load_state_dict(state[name + STATE_SUFFIX])
    position = state.get("position")
    return LoadedCheckpoint(
        uri=file_uri,
        step=int(state["epoch"]),
        names=names,
        position=EpochPosition.from_dict(position) if position else None,
        info=info_values(state),
        format_version=version,
    )


def _checkpoint_file(uri: str) -> str:
    if uri.rstrip("/").endswith(".pt"):
        return uri
    pointer = storage.join(uri, POINTER_NAME)
    if not storage.exists(pointer):
        raise FileNotFoundError(
            f"{uri} has no {POINTER_NAME}: pass a training's checkpoint_dir (after its first "
            "checkpoint) or one of its .pt files"
        )
    return read_pointer(pointer)
