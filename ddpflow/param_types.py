"""The types of the flows' parameters: bounds and help, declared once.

A flow parameter's type, bounds and help are these annotated types (or a field of a model in
flows.params built on them); its default is in that model. The trial fields
(seed to dropout, the first group below) are what a sweep trial may set. Each type carries its
bounds as pydantic metadata: the flows' parameter models
(flows.params) validate with them and the sweep's per-trial check (ddpflow.workloads.sweep.config)
reads them, so a bound is never written twice. Each `Field(...)` in a type is one check
with one message in a trial's report: a range given in one Field reads "must be between 1
and 64", bounds given in separate Fields are reported separately (a seed below 0 is told
"must be >= 0", not a range ending in a 20-digit number).
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic.fields import FieldInfo

from ddpflow.training.batching import MAX_EPOCHS, MAX_SEED

Seed = Annotated[
    int, Field(ge=0, description="data order, initial weights and sampling"), Field(le=MAX_SEED)
]
Epochs = Annotated[int, Field(ge=1, le=MAX_EPOCHS, description="passes over the training data")]
BatchSize = Annotated[int, Field(ge=1, description="samples per rank per step")]
LearningRate = Annotated[float, Field(gt=0, description="Adam learning rate"), Field(le=10)]
# Read back from checkpoints too (ddpflow.workloads.charlm.config), before allocating.
MAX_HIDDEN_SIZE = 8192
MAX_NUM_LAYERS = 64
HiddenSize = Annotated[int, Field(ge=1, le=MAX_HIDDEN_SIZE, description="LSTM units per layer")]
NumLayers = Annotated[int, Field(ge=1, le=MAX_NUM_LAYERS, description="LSTM layers")]
Dropout = Annotated[float, Field(ge=0, lt=1, description="dropout between LSTM layers")]

# A rank that makes no progress for a week is stuck; past this, timedelta overflows and
# torch.distributed cannot represent the timeout at all.
MAX_RANK_TIMEOUT_S = 7 * 24 * 3600.0

Fraction = Annotated[float, Field(gt=0, lt=1)]
KeepLast = Annotated[
    int, Field(ge=1, description="checkpoints kept per run (step checkpoints count too)")
]
# Checkpoints inside an epoch (ddpflow.checkpoint.steps); 0 turns each trigger off.
CheckpointEverySteps = Annotated[
    int, Field(ge=0, description="also a checkpoint every that many steps of an epoch; 0: off")
]
CheckpointEveryS = Annotated[
    float,
    Field(
        ge=0,
        le=MAX_RANK_TIMEOUT_S,
        description="a checkpoint inside an epoch once that many seconds passed since the last"
        " one; 0: off",
    ),
]
RankTimeout = Annotated[
    float,
    Field(
        gt=0,
        le=MAX_RANK_TIMEOUT_S,
        description="seconds a rank may take to start, in a collective or without a training"
        " step before its group fails instead of hanging",
    ),
]
Name = Annotated[str, Field(min_length=1)]
MaxRestarts = Annotated[
    int, Field(ge=0, le=100, description="relaunches of the DDP group after a failure")
]
WorldSize = Annotated[
    int | None, Field(ge=1, description="DDP ranks, one per Dask worker; unset: every worker")
]
MinWorkers = Annotated[
    int | None,
    Field(ge=1, description="fewest ranks the group goes on with after a loss; unset: all"),
]
MaxWorkers = Annotated[
    int | None,
    Field(ge=1, description="most ranks the group grows to as workers join; unset: no growing"),
]
GlobalBatch = Annotated[
    bool,
    Field(
        description="batch_size is the group's batch per step, the same on any world size "
        "(off: per rank, so the group's grows with the world size)"
    ),
]
# Data larger than memory (docs/data.md): how the formatted data reaches the ranks.
DataLayout = Annotated[
    Literal["auto", "memory", "shards"],
    Field(
        description="memory: every rank holds the formatted data; shards: formatted into "
        "shards on the cluster, each rank streams its part; auto: shards above stream_above_mb"
    ),
]
StreamAboveMb = Annotated[
    float,
    Field(gt=0, description="with data_layout auto, the formatted MiB above which ranks stream"),
]
ShardMb = Annotated[float, Field(gt=0, le=4096, description="formatted MiB per shard")]
ModelName = Annotated[str, Field(min_length=1, description="MLflow registered model")]
Experiment = Annotated[str, Field(min_length=1, description="MLflow experiment")]
# Speed settings (ddpflow.training.speed.device): "auto" picks per device on each rank (fp32, no
# channels_last and no pinning on CPU).
Precision = Annotated[
    Literal["auto", "fp32", "bf16", "fp16"],
    Field(description="auto (bf16 on GPUs, fp32 on CPU), fp32, bf16 or fp16"),
]


def _toggle(value: object) -> object:
    # One message for a bad value instead of pydantic's one per union member; the CLI
    # passes these as text.
    text = str(value).strip().lower()
    if isinstance(value, bool) or text == "auto":
        return value if isinstance(value, bool) else "auto"
    if text in ("true", "false"):
        return text == "true"
    raise ValueError("is not true, false or auto")


AutoToggle = Annotated[bool | Literal["auto"], BeforeValidator(_toggle)]
Compile = Annotated[bool, Field(description="torch.compile the DDP model")]
PinMemory = Annotated[
    AutoToggle, Field(description="page-locked batches: auto (on for GPUs), true or false")
]

# pydantic's bound names, with the operator a message shows.
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
# ... and as a refusal's fix says them (no operators: a message reads `field=value: ...`).
WORDS = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}


def bounds_of(info: FieldInfo) -> dict[str, Any]:
    """{"ge": 1, "le": 64}: the numeric bounds one Field declares."""
    found: dict[str, Any] = {}
    for item in info.metadata:
        for name in BOUNDS:
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    return found


def union_members(annotation: Any) -> tuple[Any, ...]:
    """`int | None` -> (int, NoneType); any other annotation -> (annotation,)."""
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    members = typing.get_args(annotation) if union else (annotation,)
    # A member's own Annotated metadata (a URI's min_length) is not part of its type.
    return tuple(typing.get_args(m)[0] if typing.get_origin(m) is Annotated else m for m in members)


def choices(annotation: Any) -> list[Any]:
    """The values of a Literal; with bool | Literal["auto"], the named ones first."""
    members = union_members(annotation)
    named = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    return named + (["true", "false"] if named and bool in members else [])


def limits(info: FieldInfo) -> str:
    """A field's bounds or choices as text: "1 to 64", "> 0, <= 10", "adam, sgd"."""
    named = choices(info.annotation)
    if named:
        return _listed(named)
    if _must_not_be_empty(info):
        return "not empty"
    return _bounds_text(bounds_of(info), BOUNDS, ", ")


def fix(info: FieldInfo) -> str:
    """What to pass instead of a refused value, read from the field's own declaration, so a
    bound is never restated in prose: "pass an integer from 1 to 64, e.g. 4"."""
    members = union_members(info.annotation)
    named = choices(info.annotation)
    if named:
        text = "pass one of " + _listed(named)
    elif bool in members:
        text = "pass true or false"
    elif int in members or float in members:
        kind = "an integer" if int in members else "a number"
        found = bounds_of(info)
        span = _bounds_text(found, WORDS, " and ")
        text = f"pass {kind} " + ("from " if found.keys() == {"ge", "le"} else "") + span
        text = text.rstrip()
        if isinstance(info.default, int | float) and not isinstance(info.default, bool):
            text += f", e.g. {_number(info.default)}"
    elif _must_not_be_empty(info):
        text = "pass a value that is not empty"
    else:  # text, or a JSON object or list (a sweep's grid or trials)
        kinds = {dict: "a JSON object", list: "a JSON list", str: "text"}
        given = [kinds.get(typing.get_origin(m) or m) for m in members]
        text = "pass " + " or ".join(k for k in given if k)
    return text + (", or leave it unset" if type(None) in members else "")


def _listed(named: list[Any]) -> str:
    return ", ".join(str(c) for c in named)


def _must_not_be_empty(info: FieldInfo) -> bool:
    return any(getattr(m, "min_length", None) for m in info.metadata)


def _bounds_text(found: dict[str, Any], names: dict[str, str], joiner: str) -> str:
    """ "1 to 64" for a closed range; else each bound by its name in `names`, joined."""
    if found.keys() == {"ge", "le"}:
        return f"{_number(found['ge'])} to {_number(found['le'])}"
    return joiner.join(f"{names[k]} {_number(v)}" for k, v in found.items())


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
