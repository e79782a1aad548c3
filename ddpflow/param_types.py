"""The limits of the training parameters a flow and a sweep trial both take, declared once.

Each type carries its bounds as pydantic metadata: the flows' parameter models
(flows.params) validate with them and the sweep's per-trial check (ddpflow.sweep.config)
reads them, so a bound is never written twice. Each `Field(...)` in a type is one check
with one message in a trial's report: a range given in one Field reads "must be between 1
and 64", bounds given in separate Fields are reported separately (a seed below 0 is told
"must be >= 0", not a range ending in a 20-digit number).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field
from pydantic.fields import FieldInfo

from ddpflow.batching import MAX_EPOCHS, MAX_SEED

Seed = Annotated[int, Field(ge=0), Field(le=MAX_SEED)]
Epochs = Annotated[int, Field(ge=1, le=MAX_EPOCHS)]
BatchSize = Annotated[int, Field(ge=1)]
LearningRate = Annotated[float, Field(gt=0), Field(le=10)]
HiddenSize = Annotated[int, Field(ge=1, le=8192)]
NumLayers = Annotated[int, Field(ge=1, le=64)]
Dropout = Annotated[float, Field(ge=0, lt=1)]

# pydantic's bound names, with the operator a message shows.
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def bounds_of(info: FieldInfo) -> dict[str, Any]:
    """{"ge": 1, "le": 64}: the numeric bounds one Field declares."""
    found: dict[str, Any] = {}
    for item in info.metadata:
        for name in BOUNDS:
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    return found
