"""The flows' parameters: a pydantic model per flow, its one parameter (Prefect validates it; its
schema is the deployment's form). A refusal names each field, its value (redacted) and why."""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ddpflow import param_types as t
from ddpflow.checkpoint.steps import DEFAULT_CHECKPOINT_EVERY_S
from ddpflow.distributed.supervisor.relaunch import check_world_bounds
from ddpflow.shards.encoding import DEFAULT_JPEG_QUALITY, MAX_JPEG_QUALITY, MIN_JPEG_QUALITY
from ddpflow.storage.redact import has_credentials, redact_text, redact_url
from ddpflow.training.batching import check_global_batch_fits
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.workloads.sweep.config import (
    CHARLM_FIELDS,
    IMAGE_FIELDS,
    MAX_TRIALS,
    SweepConfigError,
    TrialFields,
)
from ddpflow.workloads.sweep.space import SearchSpace, epochs_range, grid_size, parse_space
from ddpflow.workloads.vision.config import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE
from ddpflow.workloads.vision.objects import MAX_IMAGE_MB

CREDENTIALS_FIX = (  # Prefect and MLflow record parameters, for anyone who can read them
    "pass the URI without user info or query string; put credentials in the environment of the "
    "flow and its workers (a deployment: its work pool's), never in a parameter: AWS_ACCESS_KEY_ID"
    " / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, ~/.netrc (or $NETRC) for http(s)://; "
    "or download the file and pass its path"
)


def refuse_credentials(value: object) -> object:
    """A URI, stripped, or ValueError if it has user info or a query value (redacted or not)."""
    value = value.strip() if isinstance(value, str) else value
    if isinstance(value, str) and has_credentials(value.replace("***", "x")):
        why = "has user info or a query string, either of which can carry a credential"
        raise ValueError(f"{redact_url(value)} {why}; {CREDENTIALS_FIX}")
    return value


Uri = Annotated[Annotated[str, Field(min_length=1)], BeforeValidator(refuse_credentials)]
PREFIX = "invalid flow parameters: "


class ParameterError(ValueError):
    """Raised before any work starts when a flow parameter is unusable."""


class _Params(  # inf, nan: no use here; an input may hold a credential (shown redacted)
    BaseModel, extra="forbid", frozen=True, allow_inf_nan=False, hide_input_in_errors=True
):
    @model_validator(mode="wrap")
    @classmethod
    def _explain(cls, values: Any, handler: Any) -> Any:  # one error: "field=value: why; ..."
        try:
            (params := handler(values))._check()
            return params
        except ValidationError as error:
            found = [(".".join(map(str, e["loc"])), e["input"], e["msg"]) for e in error.errors()]
            problems = "; ".join(f"{field}={value!r}: {why}" for field, value, why in found)
        except ValueError as error:  # a check across fields
            problems = str(error)
        raise PydanticCustomError("flow_parameters", PREFIX + redact_text(problems))

    def _check(self) -> None: ...  # checks across fields, once each field passed its own


def validate_params(model: type[BaseModel], values: dict) -> Any:
    """`model(**values)`, or ParameterError with the model's explanation."""
    try:
        return model(**values)
    except ValidationError as error:
        raise ParameterError("; ".join(e["msg"] for e in error.errors())) from None


class _CharLM(_Params):  # the pet-name model and its data: a training's and a sweep's trials'
    source: Uri = Field(str(DEFAULT_CORPUS_PATH), description="fsspec URL of a JSON list of names")
    epochs: t.Epochs = 3
    batch_size: t.BatchSize = 512
    lr: t.LearningRate = 0.005
    hidden_size: t.HiddenSize = 128
    num_layers: t.NumLayers = 4
    dropout: t.Dropout = 0.1
    seed: t.Seed = 0
    holdout_fraction: t.Fraction = Field(0.1, description="share of distinct names held out")
    keep_last: t.KeepLast = 3
    rank_timeout_s: t.RankTimeout = 120.0
    experiment: t.Experiment = "ddpflow-charlm"


class _Training(_Params):  # what a training on the cluster takes besides its model and data
    global_batch: bool = Field(False, description="batch_size is the group's, not each rank's")
    data_layout: Literal["auto", "memory", "shards"] = Field(
        "auto", description="memory (each rank holds all), shards (ranks stream) or auto (by size)"
    )
    stream_above_mb: float = Field(2048.0, gt=0, description="auto: shards above that many MiB")
    shard_mb: float = Field(64.0, gt=0, le=4096, description="formatted MiB per shard")
    max_restarts: int = Field(2, ge=0, le=100, description="relaunches of the group on failure")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto (bf16 on GPUs, fp32 on CPU), fp32, bf16 or fp16"
    )
    pin_memory: t.AutoToggle = Field("auto", description="page-locked batches: auto (on for GPUs)")
    compile: bool = Field(False, description="torch.compile the DDP model")


class GroupParams(_Params):  # a lone training's group: its size bounds, its step checkpoints
    world_size: int | None = Field(None, ge=1, description="DDP ranks (one per worker); unset: all")
    min_workers: int | None = Field(None, ge=1, description="fewest ranks after a loss; unset: all")
    max_workers: int | None = Field(None, ge=1, description="ranks to grow to; unset: no growing")
    checkpoint_every_steps: int = Field(0, ge=0, description="also checkpoint each N steps; 0: off")
    checkpoint_every_s: t.CheckpointS = DEFAULT_CHECKPOINT_EVERY_S

    def _check(self) -> None:
        check_world_bounds(self.world_size, self.min_workers, self.max_workers)
        # global_batch and batch_size: fields of the training mixins that every GroupParams
        # class is combined with (CharLMParams, ImageParams), not of GroupParams itself.
        if self.global_batch:  # type: ignore[attr-defined]  # the largest group must fit
            size = self.max_workers or self.world_size or 1  # max_workers >= world_size
            check_global_batch_fits(self.batch_size, size)  # type: ignore[attr-defined]


class CharLMParams(GroupParams, _Training, _CharLM):  # train-charlm's
    num_names: int = Field(10, ge=0, le=10_000, description="names generated at evaluation")
    model_name: t.ModelName = "ddpflow-charlm"


class RetrainParams(CharLMParams):  # retrain-charlm's: train-charlm's, then the promotion rule
    margin: float = Field(0.0, ge=0, description="how much lower a challenger's val loss must be")


class CharLMScalingParams(_Training, _CharLM):  # scaling-charlm's: a training per world size
    world_sizes: t.WorldSizes = None
    target_loss: float | None = Field(None, gt=0, description="validation loss for time-to-target")
    keep_last: t.KeepLast = 1
    experiment: t.Experiment = "ddpflow-charlm-scaling"


DEFAULT_N_TRIALS = 20  # a search's trials when neither n_trials nor another budget is set


class _Sweep(_Params):  # a sweep's own fields, whatever its workload: its trials, their search
    trial_fields: ClassVar[TrialFields] = CHARLM_FIELDS  # what a trial may set
    grid: dict[str, Any] | None = Field(None, description="trial field -> list of values, crossed")
    trials: list[Any] | None = Field(None, description="list of {trial field: value}; or pass grid")
    search: dict[str, Any] | None = Field(
        None, description='trial field -> {"low", "high"[, "log"|"step"]} or {"choices"}; sampled'
    )
    sampler: Literal["tpe", "random", "grid"] = Field(
        "tpe", description="search: Optuna sampler (seed); grid: every point of a discrete space"
    )
    n_trials: int | None = Field(
        None,
        ge=1,
        le=MAX_TRIALS,
        description=f"search: trials to ask; unset: {DEFAULT_N_TRIALS}, every grid point "
        f"(sampler grid) or up to {MAX_TRIALS} (budget_epochs set)",
    )
    budget_epochs: int | None = Field(
        None, ge=1, description="search: no trial asked once this many trial-epochs are spent"
    )
    pruner: Literal["asha", "hyperband", "none"] = Field(
        "asha", description="search: stops poor trials at rungs (epochs)"
    )
    min_epochs: int = Field(1, ge=1, le=10000, description="search: epochs to the first rung, r")
    eta: int = Field(3, ge=2, le=100, description="search: reduction factor, rungs at r*eta^k")
    study_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="search: the study to create or resume; unset: a new one per flow run",
    )
    ranks_per_trial: int = Field(1, ge=1, description="DDP ranks (Dask workers) of each trial")

    def space(self) -> SearchSpace:
        """The search's space over the workload's trial fields (checked by _check)."""
        return parse_space(self.search, self.trial_fields)

    def trial_defaults(self) -> dict[str, Any]:
        """What a trial leaves out: the sweep's fields of the same names."""
        return {name: getattr(self, name) for name in self.trial_fields.names}

    def trials_to_ask(self) -> int:
        """The search's trial budget: n_trials, or what its unset value stands for."""
        if self.n_trials is not None:
            return self.n_trials
        if self.sampler == "grid":
            return grid_size(self.space())
        return MAX_TRIALS if self.budget_epochs is not None else DEFAULT_N_TRIALS

    def first_rung(self) -> int:
        """The fewest trial-epochs one searched trial spends: its first rung with a pruner
        (min_epochs), all its epochs without; never more than its fewest epochs."""
        fewest = epochs_range(self.space(), self.epochs)[0]  # type: ignore[attr-defined]
        return fewest if self.pruner == "none" else min(self.min_epochs, fewest)

    def _check(self) -> None:
        if self.search is None:  # grid or trials: checked when the flow plans them
            if self.budget_epochs is not None:
                raise ValueError(
                    f"budget_epochs={self.budget_epochs}: only a search (search=...) stops at a "
                    "budget; a grid or a list trains every trial, so leave budget_epochs unset"
                )
            return
        if self.grid is not None or self.trials is not None:
            raise ValueError("pass one of grid, trials or search, not several")
        try:
            space = self.space()
            points = grid_size(space) if self.sampler == "grid" else None
        except SweepConfigError as error:
            which = " for sampler grid" if self.sampler == "grid" else ""
            raise ValueError(f"invalid search space{which}: {error}") from None
        if points is not None and self.n_trials is not None and self.n_trials > points:
            raise ValueError(
                f"n_trials={self.n_trials}: the grid has {points} points and sampler grid asks "
                "each once; lower n_trials or leave it unset to run every point"
            )
        first = self.first_rung()
        if self.budget_epochs is not None and self.budget_epochs < first:
            rung = "its epochs, with pruner none" if self.pruner == "none" else "min_epochs"
            raise ValueError(
                f"budget_epochs={self.budget_epochs}: smaller than one trial's first rung "
                f"({first} trial-epochs: {rung}); raise budget_epochs to at least {first}"
            )


class SweepParams(_Sweep, _CharLM):  # sweep-charlm's: its own and every trial's defaults
    keep_last: t.KeepLast = 1
    model_name: t.ModelName = Field("ddpflow-charlm", description="MLflow model of the best trial")
    experiment: t.Experiment = "ddpflow-charlm-sweep"
    promote: bool = Field(False, description="give the best trial the champion alias if better")


class _Images(_Params):  # an image classifier and its data: a training's and a sweep's trials'
    source: Uri | None = Field(None, description="folder per class, local or s3://; unset: digits")
    arch: Literal["resnet18", "resnet50"] = Field("resnet18", description="torchvision ResNet")
    weights: Uri = Field("none", description="none, imagenet or a state_dict URI")
    freeze_backbone: bool = Field(False, description="train only the new classifier head")
    image_size: int = Field(32, ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE, description="side in pixels")
    resize: Literal["crop", "stretch"] = Field("crop", description="how an image becomes square")
    val_fraction: t.Fraction = Field(0.2, description="share of each class held out for validation")
    epochs: t.Epochs = 5
    batch_size: t.BatchSize = 32
    lr: t.LearningRate = Field(0.001, description="base learning rate, times the world size")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="adam or sgd (momentum 0.9)")
    lr_patience: int = Field(2, ge=0, description="epochs without better val loss before lr drops")
    seed: t.Seed = 0
    max_bad_fraction: float = Field(0.01, ge=0, lt=1, description="share of bad images tolerated")
    max_image_mb: float = Field(20.0, gt=0, le=MAX_IMAGE_MB, description="cap per image file, MiB")
    augment: t.AutoToggle = Field("auto", description="random crop and flip (auto: off for digits)")
    keep_last: t.KeepLast = 3
    rank_timeout_s: t.RankTimeout = 120.0
    experiment: t.Experiment = "ddpflow-images"
    channels_last: t.AutoToggle = Field("auto", description="memory format: auto (on for GPUs)")


class ImageTraining(_Images, _Training):  # what every image training takes
    # How the shards of data_layout shards hold the images (docs/data.md, measured there).
    shard_encoding: Literal["raw", "jpeg"] = Field(
        "raw", description="how shards hold images: raw pixels, or jpeg decoded on the rank"
    )
    jpeg_quality: int = Field(
        DEFAULT_JPEG_QUALITY,
        ge=MIN_JPEG_QUALITY,
        le=MAX_JPEG_QUALITY,
        description="quality of jpeg shards' images",
    )


class ImageParams(GroupParams, ImageTraining):  # train-images'
    model_name: t.ModelName = "ddpflow-images"


class ImageScalingParams(ImageTraining):  # scaling-images': a fine-tuning per world size
    world_sizes: t.WorldSizes = None
    target_accuracy: float | None = Field(None, gt=0, le=1, description="val accuracy to reach")
    keep_last: t.KeepLast = 1
    experiment: t.Experiment = "ddpflow-images-scaling"


class ImageSweepParams(_Sweep, _Images):  # sweep-images': its own and every trial's defaults
    trial_fields: ClassVar[TrialFields] = IMAGE_FIELDS
    keep_last: t.KeepLast = 1
    experiment: t.Experiment = "ddpflow-images-sweep"
    model_name: t.ModelName = Field("ddpflow-images", description="MLflow model of the best trial")

    def trial_defaults(self) -> dict[str, Any]:
        # A trial's augment is true or false: "auto" is on for a folder of the user's, off
        # for the digits demo (as train-images decides it).
        augment = self.augment is True or (self.augment == "auto" and self.source is not None)
        return {**super().trial_defaults(), "augment": augment}


AnySweepParams = SweepParams | ImageSweepParams  # what the sweep flows' shared steps take
