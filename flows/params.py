"""Validated flow parameters: every user error names the field, the value and the fix.

A URI parameter (source, weights) with user info (user:password@, TOKEN@) or a query string
is refused: Prefect records flow parameters in the flow run and MLflow logs them in the run,
so a secret passed that way would be stored for anyone who can read either. A query value
is refused whatever its name (?token=, ?accesstoken=, ?jwt=, ?sas=, ?sig=, X-Amz-Signature=
...): no list of names can tell a credential from a page number, and every query value is
shown masked (ddpflow.storage.redact), so what is accepted is exactly what is shown and
recorded. Credentials belong in the environment, where s3fs and the HTTP client already look
for them. The refusal names the parameter and the URI redacted, and the flow's recorded
parameters are redacted too (flows.redacted_flow).

The types, bounds and help shared by several flows are declared once, as annotated types,
in ddpflow.param_types; each flow's defaults are in flows.defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ddpflow.distributed.elastic import check_world_bounds
from ddpflow.param_types import (
    MAX_RANK_TIMEOUT_S,
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
    Name,
    NumLayers,
    PinMemory,
    Precision,
    RankTimeout,
    Seed,
    ShardMb,
    StreamAboveMb,
    WorldSize,
)
from ddpflow.storage.redact import has_credentials, redact_text, redact_url
from ddpflow.training.batching import MAX_EPOCHS, MAX_SEED, check_global_batch_fits
from ddpflow.workloads.vision.config import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE
from ddpflow.workloads.vision.objects import MAX_IMAGE_MB
from flows.defaults import TRAIN_CHARLM, TRAIN_IMAGES

# What to pass instead, per field, appended to pydantic's message (which says what is wrong).
FIXES = {
    "rank_timeout_s": f"pass finite seconds above 0, at most {MAX_RANK_TIMEOUT_S:g}, e.g. 120",
    "seed": f"pass an integer from 0 to {MAX_SEED}",
    "epochs": f"pass an integer from 1 to {MAX_EPOCHS}",
    "batch_size": "pass a positive integer, e.g. 64",
    "lr": "pass a learning rate above 0 and at most 10, e.g. 0.001",
    "hidden_size": "pass an integer from 1 to 8192, e.g. 128",
    "num_layers": "pass an integer from 1 to 64",
    "dropout": "pass a fraction from 0 up to (not including) 1",
    "holdout_fraction": "pass a fraction strictly between 0 and 1, e.g. 0.1",
    "val_fraction": "pass a fraction strictly between 0 and 1, e.g. 0.2",
    "max_bad_fraction": "pass a fraction from 0 up to (not including) 1, e.g. 0.01",
    "max_image_mb": f"pass a size in MiB above 0 and at most {MAX_IMAGE_MB:g}, e.g. 20",
    "world_size": "pass a positive number of ranks, or leave it unset for every worker",
    "min_workers": "pass a positive number of ranks, at most world_size",
    "max_workers": "pass a positive number of ranks, at least world_size and min_workers",
    "keep_last": "pass a positive number of checkpoints to keep",
    "checkpoint_every_steps": "pass a whole number of steps, 0 or more (0: none by step count)",
    "checkpoint_every_s": (
        f"pass seconds from 0 to {MAX_RANK_TIMEOUT_S:g}, e.g. 600 (0: no time-based checkpoints)"
    ),
    "target_loss": "pass a validation loss above 0, e.g. 2.0, or leave it unset",
    "target_accuracy": "pass an accuracy above 0 and at most 1, e.g. 0.9, or leave it unset",
    "precision": "pass auto (bf16 on GPUs, fp32 on CPU), fp32, bf16 or fp16",
    "channels_last": "pass auto (on for GPUs), true or false",
    "pin_memory": "pass auto (on for GPUs), true or false",
    "compile": "pass true or false",
    "margin": "pass a loss difference of 0 or more, e.g. 0.05",
}

CREDENTIALS_FIX = (
    "pass the URI without user info or query string and put credentials in the environment "
    "the flow and its workers run in (a deployment: its work pool's environment), never in "
    "a parameter: "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, an entry in "
    "~/.netrc (or the file $NETRC names) for http(s)://; or download the file and pass its path"
)


def refuse_credentials(value: object) -> object:
    """A URI parameter, unchanged, or ValueError when it has user info or a query value (any
    of which may be a credential: the same test as what redact_url would hide)."""
    if isinstance(value, str) and has_credentials(value):
        raise ValueError(
            f"{redact_url(value)} has user info or a query string, either of which can carry "
            f"a credential; {CREDENTIALS_FIX}"
        )
    return value


SOURCE_HELP = "any fsspec URL of a JSON list of names: local path, https://..., s3://..."
HOLDOUT_HELP = "share of distinct names held out (the split is fixed by a hash of each name)"


class ParameterError(ValueError):
    """Raised before any work starts when a flow parameter is unusable."""


class _Params(BaseModel):
    # allow_inf_nan=False: inf or nan passes a `gt=0` bound (inf) or gives a confusing
    # message (nan), and no parameter here has a use for either.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class CharLMParams(_Params):
    """The pet-name training's parameters (train-charlm, retrain-charlm, scaling-charlm).

    A flow passes every field, its defaults filled in from flows.defaults. Validated
    directly, a field without a default here is required (leaving out `epochs` is an
    error); the defaults that are here are read from flows.defaults, not written again."""

    source: Name = Field(description=SOURCE_HELP)
    epochs: Epochs
    batch_size: BatchSize = Field(
        description="samples per rank per step (global batch: batch_size x world_size), or "
        "the group's per step with global_batch"
    )
    global_batch: GlobalBatch = TRAIN_CHARLM["global_batch"]
    lr: LearningRate
    hidden_size: HiddenSize
    num_layers: NumLayers
    dropout: Dropout
    world_size: WorldSize = None
    seed: Seed
    holdout_fraction: Fraction = Field(description=HOLDOUT_HELP)
    data_layout: DataLayout = TRAIN_CHARLM["data_layout"]
    stream_above_mb: StreamAboveMb = TRAIN_CHARLM["stream_above_mb"]
    shard_mb: ShardMb = TRAIN_CHARLM["shard_mb"]
    keep_last: KeepLast
    checkpoint_every_steps: CheckpointEverySteps = TRAIN_CHARLM["checkpoint_every_steps"]
    checkpoint_every_s: CheckpointEveryS = TRAIN_CHARLM["checkpoint_every_s"]
    num_names: int = Field(ge=0, le=10_000, description="names generated at evaluation")
    rank_timeout_s: RankTimeout
    model_name: ModelName
    experiment: Experiment
    max_restarts: MaxRestarts = TRAIN_CHARLM["max_restarts"]
    min_workers: MinWorkers = TRAIN_CHARLM["min_workers"]
    max_workers: MaxWorkers = TRAIN_CHARLM["max_workers"]
    precision: Precision = TRAIN_CHARLM["precision"]
    pin_memory: PinMemory = TRAIN_CHARLM["pin_memory"]
    compile: Compile = TRAIN_CHARLM["compile"]

    # Before the length check, so a blank source is rejected rather than stripped to "".
    @field_validator("source", mode="before")
    @classmethod
    def _strip(cls, value: object) -> object:
        return refuse_credentials(value.strip() if isinstance(value, str) else value)

    @model_validator(mode="after")
    def _world_bounds_fit(self) -> CharLMParams:
        check_world_bounds(self.world_size, self.min_workers, self.max_workers)
        _check_largest_group(self.global_batch, self.batch_size, self.world_size, self.max_workers)
        return self


class SweepParams(_Params):
    """The sweep's parameters. Trials (grid or list, exactly one) are checked per trial by
    ddpflow.workloads.sweep, so one bad trial is reported while the others run."""

    source: Name = Field(description=SOURCE_HELP)
    grid: dict[str, Any] | None = Field(
        default=None, description="trial field -> list of values, expanded to every combination"
    )
    trials: list[Any] | None = Field(
        default=None, description="list of {trial field: value}; pass grid or trials"
    )
    # Defaults for every trial field a grid or trial does not set; checked here so a bad
    # default fails the sweep up front instead of failing every trial.
    epochs: Epochs
    batch_size: BatchSize
    lr: LearningRate
    hidden_size: HiddenSize
    num_layers: NumLayers
    dropout: Dropout
    seed: Seed
    ranks_per_trial: int = Field(ge=1, description="DDP ranks (Dask workers) of each trial")
    holdout_fraction: Fraction = Field(description=HOLDOUT_HELP)
    keep_last: KeepLast
    rank_timeout_s: RankTimeout
    model_name: ModelName = Field(description="MLflow registered model of the best trial")
    experiment: Experiment
    promote: bool = Field(description="give the best trial the champion alias if it beats it")

    @field_validator("source", mode="before")
    @classmethod
    def _strip(cls, value: object) -> object:
        return refuse_credentials(value.strip() if isinstance(value, str) else value)


class RetrainParams(_Params):
    """What retrain-charlm adds to the training's parameters: the promotion rule."""

    margin: float = Field(
        ge=0, description="how much lower the challenger's holdout loss must be to promote it"
    )


class ScalingParams(_Params):
    """What a scaling flow adds to its training flow's parameters (validated by those).
    `world_sizes` is parsed and fitted to the cluster by ddpflow.workloads.scaling."""

    world_sizes: str | None = Field(
        default=None, description="world sizes to train at, e.g. 1,2,4; unset: 1 to all workers"
    )
    target_loss: float | None = Field(
        default=None, gt=0, description="validation loss for the time-to-target column"
    )
    target_accuracy: float | None = Field(
        default=None, gt=0, le=1, description="validation accuracy for the time-to-target column"
    )


def _check_largest_group(
    global_batch: bool, batch_size: int, world_size: int | None, max_workers: int | None
) -> None:
    """A global batch must feed each rank of the largest group the flow may run."""
    if global_batch:
        check_global_batch_fits(batch_size, max(world_size or 1, max_workers or 1))


def validate_params(model: type[BaseModel], values: dict) -> BaseModel:
    try:
        return model(**values)
    except ValidationError as error:
        # Each problem quotes the value given, which may be a URI with credentials.
        problems = redact_text("; ".join(_describe(e) for e in error.errors()))
        raise ParameterError(f"invalid flow parameters: {problems}") from None


def _describe(error: dict) -> str:
    field = ".".join(str(p) for p in error["loc"])
    if error["type"] == "missing":
        # The "input" of a missing field is the whole parameter dict (source URL included).
        return f"{field}: {error['msg']}"
    if not field:  # a check across fields: its message names them and the fix
        return error["msg"].removeprefix("Value error, ")
    fix = FIXES.get(field)
    return f"{field}={error.get('input')!r}: {error['msg']}" + (f"; {fix}" if fix else "")


class ImageParams(_Params):
    """The image flow's parameters (train-images)."""

    source: str | None = Field(
        default=None,
        description="image folder, one subfolder per class, local or s3://; unset: the digits demo",
    )
    arch: Literal["resnet18", "resnet50"] = Field(description="torchvision ResNet")
    weights: str = Field(min_length=1, description="none, imagenet or a state_dict URI")
    freeze_backbone: bool = Field(description="train only the new classifier head")
    image_size: int = Field(
        ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE, description="side of the square model input, pixels"
    )
    resize: Literal["crop", "stretch"] = Field(description="how an image becomes square")
    val_fraction: Fraction = Field(description="share of each class held out for validation")
    epochs: Epochs
    batch_size: BatchSize = Field(
        description="images per rank per step (the group's per step with global_batch)"
    )
    global_batch: GlobalBatch = TRAIN_IMAGES["global_batch"]
    lr: LearningRate = Field(description="base learning rate, multiplied by the world size")
    optimizer: Literal["adam", "sgd"] = Field(description="adam or sgd (momentum 0.9)")
    lr_patience: int = Field(
        ge=0, description="epochs without a better val loss before the lr is lowered"
    )
    world_size: WorldSize = None
    seed: Seed
    max_bad_fraction: float = Field(
        ge=0, lt=1, description="share of unreadable images tolerated (skipped and listed)"
    )
    max_image_mb: float = Field(
        default=TRAIN_IMAGES["max_image_mb"],
        gt=0,
        le=MAX_IMAGE_MB,
        description="cap per image file, MiB",
    )
    data_layout: DataLayout = TRAIN_IMAGES["data_layout"]
    stream_above_mb: StreamAboveMb = TRAIN_IMAGES["stream_above_mb"]
    shard_mb: ShardMb = TRAIN_IMAGES["shard_mb"]
    augment: AutoToggle = Field(
        default=TRAIN_IMAGES["augment"],
        description="random resized crop and flip of training images, new every epoch: auto "
        "(on, but off for the digits demo: a mirrored digit is another shape), true or false",
    )
    keep_last: KeepLast
    checkpoint_every_steps: CheckpointEverySteps = TRAIN_IMAGES["checkpoint_every_steps"]
    checkpoint_every_s: CheckpointEveryS = TRAIN_IMAGES["checkpoint_every_s"]
    rank_timeout_s: RankTimeout
    max_restarts: MaxRestarts = TRAIN_IMAGES["max_restarts"]
    min_workers: MinWorkers = TRAIN_IMAGES["min_workers"]
    max_workers: MaxWorkers = TRAIN_IMAGES["max_workers"]
    model_name: ModelName
    experiment: Experiment
    precision: Precision = TRAIN_IMAGES["precision"]
    channels_last: AutoToggle = Field(
        default=TRAIN_IMAGES["channels_last"],
        description="channels_last memory format: auto (on for GPUs), true or false",
    )
    pin_memory: PinMemory = TRAIN_IMAGES["pin_memory"]
    compile: Compile = TRAIN_IMAGES["compile"]

    @field_validator("source", "weights", mode="before")
    @classmethod
    def _strip(cls, value: object) -> object:
        return refuse_credentials(value.strip() if isinstance(value, str) else value)

    @field_validator("source")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("source is blank; pass an image folder URI or leave it unset")
        return value

    @model_validator(mode="after")
    def _world_bounds_fit(self) -> ImageParams:
        check_world_bounds(self.world_size, self.min_workers, self.max_workers)
        _check_largest_group(self.global_batch, self.batch_size, self.world_size, self.max_workers)
        return self
