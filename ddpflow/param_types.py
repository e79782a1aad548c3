"""The flows' shared parameter types (type, bounds, help): flows.params builds on them and the
sweep's trial check reads the trial types' bounds with bounds_of, one check per Field."""

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic.fields import FieldInfo

from ddpflow.training.batching import MAX_EPOCHS, MAX_SEED

MAX_HIDDEN_SIZE, MAX_NUM_LAYERS = 8192, 64  # read back from checkpoints too, before allocating
MAX_RANK_TIMEOUT_S = 7 * 24 * 3600.0  # a week without progress is stuck; timedelta overflows

SEED_HELP = "data order, initial weights and sampling"
Seed = Annotated[int, Field(ge=0, description=SEED_HELP), Field(le=MAX_SEED)]  # a message per bound
Epochs = Annotated[int, Field(ge=1, le=MAX_EPOCHS, description="passes over the training data")]
BatchSize = Annotated[int, Field(ge=1, description="samples per rank per step")]
LearningRate = Annotated[float, Field(gt=0, description="Adam learning rate"), Field(le=10)]
HiddenSize = Annotated[int, Field(ge=1, le=MAX_HIDDEN_SIZE, description="LSTM units per layer")]
NumLayers = Annotated[int, Field(ge=1, le=MAX_NUM_LAYERS, description="LSTM layers")]
Dropout = Annotated[float, Field(ge=0, lt=1, description="dropout between LSTM layers")]
Fraction = Annotated[float, Field(gt=0, lt=1)]
KEEP_LAST_HELP = "checkpoints kept per run, in the store and in MLflow (step ones count too)"
KeepLast = Annotated[int, Field(ge=1, description=KEEP_LAST_HELP)]
TIMEOUT_HELP = "seconds a rank may take to start, in a collective or per step, else its group fails"
RankTimeout = Annotated[float, Field(gt=0, le=MAX_RANK_TIMEOUT_S, description=TIMEOUT_HELP)]
Experiment = Annotated[str, Field(min_length=1, description="MLflow experiment")]
ModelName = Annotated[str, Field(min_length=1, description="MLflow registered model")]
EVERY_S_HELP = "also a checkpoint each that many seconds of an epoch; 0: off"
CheckpointS = Annotated[float, Field(ge=0, le=MAX_RANK_TIMEOUT_S, description=EVERY_S_HELP)]
WorldSizes = Annotated[str | None, Field(description="sizes, e.g. 1,2,4; unset: 1 to all workers")]


def _toggle(value: object) -> object:
    found = {"true": True, "false": False, "auto": "auto"}.get(str(value).strip().lower())
    if found is None:
        raise ValueError("is not true, false or auto")
    return found


AutoToggle = Annotated[bool | Literal["auto"], BeforeValidator(_toggle)]  # one message if bad
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}  # pydantic's bound names, as operators


def bounds_of(info: FieldInfo) -> dict[str, Any]:
    """{"ge": 1, "le": 64}: the numeric bounds one Field (or a model's field) declares."""
    found = ((k, getattr(m, k, None)) for m in info.metadata for k in BOUNDS)
    return {k: v for k, v in found if v is not None}
