"""Checkpoints: plain state_dicts plus the model config, with a pointer to the latest good one.

One format for every training (TrainContext.save_checkpoint writes it, the built-in workloads
included): {"format_version": 1, "epoch": <step>, "<name>_state": <state_dict> for each named
object (model, optimizer, scheduler, scaler...), plus plain `info` values (the workloads'
"model_config" and "extra") and, inside an epoch, "position"}. One load restores everything.

Layout under a run's checkpoint folder:
    epoch-0001.pt    torch.save of a dict of tensors and plain values (weights_only loadable)
    epoch-0001.step-00000030.pt
                     a checkpoint inside epoch 2, after 1 epoch and 30 of its steps; it also
                     holds a "position" (ddpflow.checkpoint.steps.EpochPosition). Names sort
                     in training order ("." sorts after "-" and "p" before "s").
    latest.json      {"uri": ".../epoch-0001.pt", "epoch": 1}, rewritten only after the
                     checkpoint it names was written completely
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import torch
from torch import nn

from ddpflow import storage
from ddpflow.checkpoint.steps import EpochPosition
from ddpflow.config import STORE_OUTAGE_ENV, store_outage_s
from ddpflow.distributed.supervisor import heartbeats
from ddpflow.storage.redact import redact_text
from ddpflow.storage.retry import retry_for
from ddpflow.tracking.loggers import MetricLogger

FORMAT_VERSION = 1
LATEST_CHECKPOINT_TAG = "ddpflow.latest_checkpoint"
POINTER_NAME = "latest.json"
POINTER_MAX_BYTES = 2**16  # {"uri": ..., "epoch": N}
log = logging.getLogger(__name__)


@overload
def unwrap(model: nn.Module) -> nn.Module: ...
@overload
def unwrap(model: Stateful) -> Stateful: ...
def unwrap(model: nn.Module | Stateful) -> nn.Module | Stateful:
    """The plain module inside a DistributedDataParallel wrapper (or the module itself, or
    any other Stateful a checkpoint carries)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class Stateful(Protocol):
    """Anything a checkpoint can carry: a module, an optimizer, an LR scheduler, a GradScaler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


STATE_SUFFIX = "_state"
RESERVED_KEYS = {"format_version", "epoch", "position"}


def pack_state(
    epoch: int, objects: Mapping[str, Stateful], info: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A checkpoint of `objects` (each saved as "<name>_state", unwrapped from DDP) after
    `epoch` epochs (or steps), with plain `info` values beside them."""
    info = dict(info or {})
    check_info(info)
    states = {name + STATE_SUFFIX: unwrap(obj).state_dict() for name, obj in objects.items()}
    return {"format_version": FORMAT_VERSION, "epoch": epoch, **info, **states}


def check_info(info: Mapping[str, Any] | None) -> None:
    """Checkpoint info keys must not shadow the format's own keys."""
    clashes = sorted(k for k in info or {} if k in RESERVED_KEYS or k.endswith(STATE_SUFFIX))
    if clashes:
        raise ValueError(
            f"checkpoint info keys {clashes} are reserved: rename them (not "
            f"{sorted(RESERVED_KEYS)}, not ending in {STATE_SUFFIX!r})"
        )


def saved_names(state: Mapping[str, Any]) -> list[str]:
    """The names of the objects a checkpoint holds."""
    return sorted(k.removesuffix(STATE_SUFFIX) for k in state if k.endswith(STATE_SUFFIX))


def info_values(state: Mapping[str, Any]) -> dict[str, Any]:
    """The plain `info` values saved beside the objects (neither format keys nor states)."""
    return {
        k: v for k, v in state.items() if k not in RESERVED_KEYS and not k.endswith(STATE_SUFFIX)
    }


def unpack_state(state: Mapping[str, Any], objects: Mapping[str, Stateful], uri: str) -> int:
    """Load a checkpoint into the named objects, which must be exactly the ones it holds;
    the epoch (or step) it was saved after."""
    saved = saved_names(state)
    if not saved or "epoch" not in state:
        raise ValueError(
            f"{uri} was not written by TrainContext.save_checkpoint(): give the training a "
            "checkpoint folder of its own"
        )
    if saved != sorted(objects):
        raise ValueError(
            f"resume() got {sorted(objects)} but the checkpoint holds {saved} ({uri}): "
            "pass the same names to resume() and save_checkpoint()"
        )
    for name, obj in objects.items():
        unwrap(obj).load_state_dict(state[name + STATE_SUFFIX])
    return int(state["epoch"])


def build_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    model_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    speed: Stateful | None = None,
) -> dict[str, Any]:
    """A built-in workload's checkpoint: enough to rebuild the model and continue training
    (with `speed`, its GradScaler's scale too: an fp16 run resumes with the same scale)."""
    objects: dict[str, Stateful] = {"model": model, "optimizer": optimizer}
    if speed is not None:
        objects["scaler"] = speed
    info = {"model_config": dict(model_config), "extra": dict(extra or {})}
    return pack_state(epoch, objects, info)


def encode(state: dict[str, Any]) -> bytes:
    """Serialise once; the same bytes go to the artifact store and to MLflow."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# The folder of a run's artifacts in MLflow that holds its epoch-end checkpoints.
CHECKPOINT_ARTIFACTS = "checkpoints"


@dataclass(frozen=True)
class CheckpointStore:
    """Checkpoints of one run in one folder URI; keeps the newest `keep_last` of them."""

    root: str
    keep_last: int = 3

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")

    def uri_for(self, epoch: int, step: int | None = None) -> str:
        """`epoch` epochs done, plus `step` steps of the next one (None: at the epoch end)."""
        inside = "" if step is None else f".step-{step:08d}"
        return storage.join(self.root, f"epoch-{epoch:04d}{inside}.pt")

    def save(self, state: dict[str, Any]) -> str:
        position = state.get("position")
        step = None if position is None else int(position["step"])
        return self.save_encoded(int(state["epoch"]), encode(state), step)

    def save_encoded(self, epoch: int, data: bytes, step: int | None = None) -> str:
        """Write the checkpoint, then move the pointer to it, then prune old ones.

        An unreachable store is waited out: each write is retried with backoff, both within
        one window of store_outage_s() seconds. The pointer moves only once the checkpoint
        is complete, so during an outage, and after one that outlasts the window (the run
        fails, naming the setting), `latest` still names the previous complete checkpoint.
        """
        uri = self.uri_for(epoch, step)
        write = _outage_tolerant_writer()
        write(uri, data)
        pointer = {"uri": uri, "epoch": epoch}
        write(storage.join(self.root, POINTER_NAME), json.dumps(pointer).encode())
        try:
            self._prune()
        except Exception as error:  # noqa: BLE001 - the checkpoint is saved; prune next time
            log.warning("could not prune old checkpoints: %s", redact_text(str(error)))
        return uri

    def latest_uri(self) -> str | None:
        pointer_uri = storage.join(self.root, POINTER_NAME)
        if not storage.exists(pointer_uri):
            return None
        return read_pointer(pointer_uri)

    def load(self, uri: str | None = None) -> dict[str, Any]:
        """Load a checkpoint (the latest complete one by default) with weights_only=True."""
        uri = uri or self.latest_uri()
        if uri is None:
            raise FileNotFoundError(f"no checkpoint under {self.root} (no {POINTER_NAME})")
        return storage.load_torch(uri, "pass a checkpoint file or folder written by ddpflow")

    def list_uris(self) -> list[str]:
        names = storage.list_names(self.root)
        return [storage.join(self.root, n) for n in names if _is_checkpoint_name(n)]

    def _prune(self) -> None:
        # Names sort by epoch; the pointer's target is never deleted, whatever its age.
        uris = self.list_uris()
        keep = set(uris[-self.keep_last :]) | {self.latest_uri()}
        for uri in uris:
            if uri not in keep:
                storage.delete(uri)


def read_pointer(pointer_uri: str) -> str:
    """The checkpoint URI a `latest.json` names; ValueError naming the file when it is not one.

    Read with a cap: the folder may be anyone's (a registry tag or a user names it), and a
    pointer that is a FIFO or a huge file must fail, not hang or fill memory.
    """
    fix = f"pass a training's checkpoint_dir, whose {POINTER_NAME} ddpflow wrote"
    data = storage.read_bytes(pointer_uri, POINTER_MAX_BYTES, fix)
    try:
        uri = json.loads(data)["uri"]
    except (ValueError, TypeError, KeyError) as error:  # bad UTF-8 is a ValueError too
        raise ValueError(
            f"{pointer_uri} is not a checkpoint pointer ({error!r:.100}); {fix}"
        ) from None
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"{pointer_uri} names no checkpoint file ({uri!r:.100}); {fix}")
    return uri


def _outage_tolerant_writer() -> Callable[[str, bytes], None]:
    """storage.write_bytes retried through a store outage, all calls within one window.

    The window is DDPFLOW_STORE_OUTAGE_S. Between attempts this rank beats, so the
    launcher's watchdog does not take the outage for a hang; the other ranks of its group
    wait for it beating too (RankContext.rank0_io), so the window holds in a group as well.
    """
    bound = store_outage_s()
    hint = f"raise {STORE_OUTAGE_ENV} (now {bound:g} s) to wait longer"
    deadline = time.monotonic() + bound

    def write(uri: str, data: bytes) -> None:
        retry_for(
            lambda: storage.write_bytes(uri, data),
            what=f"checkpoint write to {uri}",
            bound_s=max(0.0, deadline - time.monotonic()),
            hint=hint,
            on_wait=heartbeats.beat_this_thread,
            sleep=time.sleep,  # looked up per call: unit tests swap in a fake clock
            clock=time.monotonic,
        )

    return write


def _is_checkpoint_name(name: str) -> bool:
    return name.startswith("epoch-") and name.endswith(".pt")


def resume_from(
    store: CheckpointStore, objects: Mapping[str, Stateful]
) -> tuple[int, EpochPosition | None, dict[str, Any]]:
    """Load the latest complete checkpoint into the named objects: the epochs (or steps) it
    was saved after (0: none yet), where inside the next epoch it was taken (None: at an
    epoch's end), and the plain `info` values saved beside the objects."""
    uri = store.latest_uri()
    if uri is None:
        return 0, None, {}
    state = store.load(uri)
    epoch = unpack_state(state, objects, uri)
    position = state.get("position")
    return epoch, EpochPosition.from_dict(position) if position else None, info_values(state)


def record_checkpoint(
    logger: MetricLogger, uri: str, data: bytes, kept: Sequence[str] | None = None
) -> None:
    """Copy the checkpoint into the MLflow run and tag where the original lives.

    `kept`: the checkpoint names the store keeps; MLflow's copies are pruned to those, so
    `keep_last` holds for both (None: prune nothing)."""
    name = uri.rsplit("/", 1)[-1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        logger.log_artifact(path, CHECKPOINT_ARTIFACTS, origin=uri)
    if kept is not None:
        logger.keep_artifacts(CHECKPOINT_ARTIFACTS, sorted({*kept, name}))
    logger.set_tags({LATEST_CHECKPOINT_TAG: uri})


def write_checkpoint(
    store: CheckpointStore,
    logger: MetricLogger,
    epoch: int,
    state: dict[str, Any],
    position: EpochPosition | None = None,
) -> str:
    """A workload's checkpoint: `epoch` epochs done, plus `position` inside the next one.

    Epoch-end checkpoints are also copied into the MLflow run, which then holds the same
    epoch-end checkpoints as the store (its newest `keep_last`); step checkpoints stay in
    the store only.
    """
    if position is not None:
        state["position"] = position.to_dict()
    uri = store.save_encoded(epoch, data := encode(state), position.step if position else None)
    if position is None:
        kept = [u.rsplit("/", 1)[-1] for u in store.list_uris()]
        record_checkpoint(logger, uri, data, kept=[n for n in kept if ".step-" not in n])
    return uri
