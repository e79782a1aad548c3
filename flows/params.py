"""The flows' parameters: one pydantic model per flow, which the flow takes as its parameter.

Prefect validates a flow's parameters against its signature, so `train_charlm(training=...)`
is checked by Prefect itself, and the model's JSON schema (each field's type, bounds, help
and default) is the deployment's parameter form and what Prefect's server checks a
`prefect deployment run --param training='{...}'` against. A field's type, bounds and help
are the annotated types of ddpflow.param_types (the sweep's per-trial check reads the same
ones); its default is written here, once; a flow whose default differs (a scaling run keeps
one checkpoint) overrides it in its own model.

Every refusal names the field, the value and the fix, whoever validates: the model explains
pydantic's errors itself, so Prefect's "invalid parameters" message carries it. The fix is
read from the field's declaration (ddpflow.param_types.fix: "pass an integer from 1 to 64,
e.g. 4"), so a bound is written once; a validator's own refusal (a URI with a credential)
says its fix itself.

A URI parameter (source, weights) with user info (user:password@, TOKEN@) or any query value
(?token=, ?sig=, X-Amz-Signature= ...) is refused: Prefect records a flow run's parameters
and MLflow logs them, so a secret passed that way would be stored for anyone who can read
either. Every query value is shown masked (ddpflow.storage.redact), so what is accepted is
exactly what is shown and recorded. Prefect records the parameters before it validates them:
the command line (flows.cli) hands Prefect a refused value redacted; a dict passed to a flow
from Python is recorded as given, like a deployment run's parameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ddpflow.checkpoint.steps import DEFAULT_CHECKPOINT_EVERY_S
from ddpflow.distributed.elastic import check_world_bounds
from ddpflow.param_types import (
    AutoToggle,
    BatchSize,
    CheckpointEveryS,
    CheckpointEverySteps,
    Compile,
    DataLayout,
    Dropout,
    Epochs,
    Experiment,
    Fraction,
    GlobalBatch,
    HiddenSize,
    KeepLast,
    LearningRate,
    MaxRestarts,
    MaxWorkers,
    MinWorkers,
    ModelName,
    NumLayers,
    PinMemory,
    Precision,
    RankTimeout,
    Seed,
    ShardMb,
    StreamAboveMb,
    WorldSize,
    fix,
)
from ddpflow.storage.redact import has_credentials, redact_text, redact_url
from ddpflow.training.batching import check_global_batch_fits
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.workloads.vision.config import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE
from ddpflow.workloads.vision.objects import MAX_IMAGE_MB

CREDENTIALS_FIX = (
    "pass the URI without user info or query string and put credentials in the environment "
    "the flow and its workers run in (a deployment: its work pool's environment), never in "
    "a parameter: "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, an entry in "
    "~/.netrc (or the file $NETRC names) for http(s)://; or download the file and pass its path"
)


def refuse_credentials(value: object) -> object:
    """A URI parameter, stripped, or ValueError when it has user info or a query value (any
    of which may be a credential: the same test as what redact_url would hide)."""
    value = value.strip() if isinstance(value, str) else value
    # A value redacted already (flows.cli hands Prefect a refused one so) is refused alike.
    if isinstance(value, str) and has_credentials(value.replace("***", "x")):
        raise ValueError(
            f"{redact_url(value)} has user info or a query string, either of which can carry "
            f"a credential; {CREDENTIALS_FIX}"
        )
    return value


# Stripped and checked before the length check, so a blank URI is refused, not kept as "".
Uri = Annotated[Annotated[str, Field(min_length=1)], BeforeValidator(refuse_credentials)]
OptionalUri = Annotated[
    Annotated[str, Field(min_length=1)] | None, BeforeValidator(refuse_credentials)
]
SOURCE_HELP = "any fsspec URL of a JSON list of names: local path, https://..., s3://..."
HOLDOUT_HELP = "share of distinct names held out (the split is fixed by a hash of each name)"
CHARLM_SOURCE = str(DEFAULT_CORPUS_PATH)
NumNames = Annotated[int, Field(ge=0, le=10_000, description="names generated at evaluation")]
WorldSizes = Annotated[
    str | None,
    Field(description="world sizes to train at, e.g. 1,2,4; unset: 1 to all workers"),
]


class ParameterError(ValueError):
    """Raised before any work starts when a flow parameter is unusable."""


class _Params(BaseModel):
    # allow_inf_nan=False: inf or nan passes a `gt=0` bound (inf) or gives a confusing
    # message (nan), and no parameter here has a use for either. hide_input_in_errors: an
    # input may be a URI with a credential; the explanation below shows values redacted.
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, hide_input_in_errors=True
    )

    @model_validator(mode="wrap")
    @classmethod
    def _explain(cls, values: Any, handler: Any) -> Any:
        try:
            params = handler(values)
        except ValidationError as error:
            raise _explained("; ".join(_describe(cls, e) for e in error.errors())) from None
        try:
            params._check()
        except ValueError as error:
            raise _explained(str(error)) from None
        return params

    def _check(self) -> None:
        """Checks across fields, once each field passed its own."""


def _explained(problems: str) -> PydanticCustomError:
    # A custom error's message is a template: braces (a JSON grid) are escaped.
    text = f"invalid flow parameters: {redact_text(problems)}"
    return PydanticCustomError("flow_parameters", text.replace("{", "{{").replace("}", "}}"))


def _describe(model: type[BaseModel], error: Any) -> str:
    field = ".".join(str(p) for p in error["loc"])
    if error["type"] == "flow_parameters":  # a nested model's, explained already
        return error["msg"].removeprefix("invalid flow parameters: ")
    info = model.model_fields.get(str(error["loc"][0])) if error["loc"] else None
    # A validator's ValueError (a URI with a credential) carries its own fix.
    fixed = info is not None and error["type"] != "value_error"
    return f"{field}={error.get('input')!r}: {error['msg']}" + (f"; {fix(info)}" if fixed else "")


def validate_params(model: type[BaseModel], values: dict) -> Any:
    """`model(**values)`, or ParameterError with the model's explanation."""
    try:
        return model(**values)
    except ValidationError as error:
        raise ParameterError("; ".join(e["msg"] for e in error.errors())) from None


class GroupParams(_Params):
    """A lone training's group on the cluster: its size bounds and its step checkpoints (a
    scaling run sets the size itself and keeps epoch checkpoints only)."""

    world_size: WorldSize = None
    min_workers: MinWorkers = None
    max_workers: MaxWorkers = None
    checkpoint_every_steps: CheckpointEverySteps = 0
    checkpoint_every_s: CheckpointEveryS = DEFAULT_CHECKPOINT_EVERY_S

    def _check(self) -> None:
        check_world_bounds(self.world_size, self.min_workers, self.max_workers)
        # A global batch must feed each rank of the largest group the flow may run. (Both
        # trainings that take a group declare batch_size and global_batch.)
        if self.global_batch:  # type: ignore[attr-defined]
            largest = max(self.world_size or 1, self.max_workers or 1)
            check_global_batch_fits(self.batch_size, largest)  # type: ignore[attr-defined]


class CharLMTraining(_Params):
    """What every pet-name training takes (train-charlm, retrain-charlm, scaling-charlm)."""

    source: Uri = Field(CHARLM_SOURCE, description=SOURCE_HELP)
    epochs: Epochs = 3
    batch_size: BatchSize = Field(
        512,
        description="samples per rank per step (global batch: batch_size x world_size), or "
        "the group's per step with global_batch",
    )
    global_batch: GlobalBatch = False
    lr: LearningRate = 0.005
    hidden_size: HiddenSize = 128
    num_layers: NumLayers = 4
    dropout: Dropout = 0.1
    seed: Seed = 0
    holdout_fraction: Fraction = Field(0.1, description=HOLDOUT_HELP)
    data_layout: DataLayout = "auto"
    stream_above_mb: StreamAboveMb = 2048.0
    shard_mb: ShardMb = 64.0
    keep_last: KeepLast = 3
    rank_timeout_s: RankTimeout = 120.0
    max_restarts: MaxRestarts = 2
    experiment: Experiment = "ddpflow-charlm"
    precision: Precision = "auto"
    pin_memory: PinMemory = "auto"
    compile: Compile = False


class CharLMParams(GroupParams, CharLMTraining):
    """train-charlm's parameters: a training on the cluster, evaluated and registered."""

    num_names: NumNames = 10
    model_name: ModelName = "ddpflow-charlm"


class RetrainParams(CharLMParams):
    """retrain-charlm's: the challenger trains as train-charlm does, then the promotion rule."""

    margin: float = Field(
        0.0, ge=0, description="how much lower the challenger's holdout loss must be to promote it"
    )


class CharLMScalingParams(CharLMTraining):
    """scaling-charlm's: the training at each world size (nothing evaluated or registered)."""

    world_sizes: WorldSizes = None
    target_loss: float | None = Field(
        None, gt=0, description="validation loss for the time-to-target column"
    )
    keep_last: KeepLast = 1
    experiment: Experiment = "ddpflow-charlm-scaling"


class SweepParams(_Params):
    """The sweep's parameters. Trials (grid or list, exactly one) are checked per trial by
    ddpflow.workloads.sweep, so one bad trial is reported while the others run."""

    source: Uri = Field(CHARLM_SOURCE, description=SOURCE_HELP)
    grid: dict[str, Any] | None = Field(
        None, description="trial field -> list of values, expanded to every combination"
    )
    trials: list[Any] | None = Field(
        None, description="list of {trial field: value}; pass grid or trials"
    )
    # Defaults for every trial field a grid or trial does not set; checked here so a bad
    # default fails the sweep up front instead of failing every trial.
    epochs: Epochs = CharLMTraining.model_fields["epochs"].default
    batch_size: BatchSize = CharLMTraining.model_fields["batch_size"].default
    lr: LearningRate = CharLMTraining.model_fields["lr"].default
    hidden_size: HiddenSize = CharLMTraining.model_fields["hidden_size"].default
    num_layers: NumLayers = CharLMTraining.model_fields["num_layers"].default
    dropout: Dropout = CharLMTraining.model_fields["dropout"].default
    seed: Seed = 0
    ranks_per_trial: int = Field(1, ge=1, description="DDP ranks (Dask workers) of each trial")
    holdout_fraction: Fraction = Field(0.1, description=HOLDOUT_HELP)
    keep_last: KeepLast = 1
    rank_timeout_s: RankTimeout = 120.0
    model_name: ModelName = Field(
        "ddpflow-charlm", description="MLflow registered model of the best trial"
    )
    experiment: Experiment = "ddpflow-charlm-sweep"
    promote: bool = Field(
        False, description="give the best trial the champion alias if it beats it"
    )


class ImageTraining(_Params):
    """What every image training takes (train-images, scaling-images)."""

    source: OptionalUri = Field(
        None,
        description="image folder, one subfolder per class, local or s3://; unset: the digits demo",
    )
    arch: Literal["resnet18", "resnet50"] = Field("resnet18", description="torchvision ResNet")
    weights: Uri = Field("none", description="none, imagenet or a state_dict URI")
    freeze_backbone: bool = Field(False, description="train only the new classifier head")
    image_size: int = Field(
        32, ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE, description="side of the square input, pixels"
    )
    resize: Literal["crop", "stretch"] = Field("crop", description="how an image becomes square")
    val_fraction: Fraction = Field(0.2, description="share of each class held out for validation")
    epochs: Epochs = 5
    batch_size: BatchSize = Field(
        32, description="images per rank per step (the group's per step with global_batch)"
    )
    global_batch: GlobalBatch = False
    lr: LearningRate = Field(0.001, description="base learning rate, multiplied by the world size")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="adam or sgd (momentum 0.9)")
    lr_patience: int = Field(
        2, ge=0, description="epochs without a better val loss before the lr is lowered"
    )
    seed: Seed = 0
    max_bad_fraction: float = Field(
        0.01, ge=0, lt=1, description="share of unreadable images tolerated (skipped and listed)"
    )
    max_image_mb: float = Field(20.0, gt=0, le=MAX_IMAGE_MB, description="cap per image file, MiB")
    data_layout: DataLayout = "auto"
    stream_above_mb: StreamAboveMb = 2048.0
    shard_mb: ShardMb = 64.0
    augment: AutoToggle = Field(
        "auto",
        description="random resized crop and flip of training images, new every epoch: auto "
        "(on, but off for the digits demo: a mirrored digit is another shape), true or false",
    )
    keep_last: KeepLast = 3
    rank_timeout_s: RankTimeout = 120.0
    max_restarts: MaxRestarts = 2
    experiment: Experiment = "ddpflow-images"
    precision: Precision = "auto"
    channels_last: AutoToggle = Field(
        "auto", description="channels_last memory format: auto (on for GPUs), true or false"
    )
    pin_memory: PinMemory = "auto"
    compile: Compile = False


class ImageParams(GroupParams, ImageTraining):
    """train-images' parameters: a training on the cluster, evaluated and registered."""

    model_name: ModelName = "ddpflow-images"


class ImageScalingParams(ImageTraining):
    """scaling-images': the fine-tuning at each world size (nothing evaluated or registered)."""

    world_sizes: WorldSizes = None
    target_accuracy: float | None = Field(
        None, gt=0, le=1, description="validation accuracy for the time-to-target column"
    )
    keep_last: KeepLast = 1
    experiment: Experiment = "ddpflow-images-scaling"
