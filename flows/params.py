"""Validated flow parameters: every user error names the field, the value and the fix.

A URI parameter (source, weights) that embeds credentials (user:password@, ?token=...,
X-Amz-Signature=...) is refused: Prefect records flow parameters in the flow run and
MLflow logs them in the run, so a secret passed that way would be stored for anyone who
can read either. Credentials belong in the environment, where s3fs and the HTTP client
already look for them. The refusal names the URI redacted, and the flow's recorded
parameters are redacted too (flows.redacted_flow).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ddpflow.redact import has_credentials, redact_text, redact_url

CREDENTIALS_FIX = (
    "pass the URI without credentials and put them in the environment instead: "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, an entry in "
    "~/.netrc (or the file $NETRC names) for http(s)://; or download the file and pass its path"
)


def refuse_credentials(value: object) -> object:
    """A URI parameter, unchanged, or ValueError when it embeds credentials."""
    if isinstance(value, str) and has_credentials(value):
        raise ValueError(f"{redact_url(value)} embeds credentials; {CREDENTIALS_FIX}")
    return value


class ParameterError(ValueError):
    """Raised before any work starts when a flow parameter is unusable."""


class CharLMParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(min_length=1)
    epochs: int = Field(ge=1, le=10_000)
    batch_size: int = Field(ge=1, description="samples per rank per step")
    lr: float = Field(gt=0, le=10)
    hidden_size: int = Field(ge=1, le=8192)
    num_layers: int = Field(ge=1, le=64)
    dropout: float = Field(ge=0, lt=1)
    world_size: int | None = Field(default=None, ge=1, description="None: every worker")
    seed: int = Field(ge=0)
    holdout_fraction: float = Field(gt=0, lt=1)
    keep_last: int = Field(ge=1)
    num_names: int = Field(ge=0, le=10_000)
    rank_timeout_s: float = Field(gt=0)
    model_name: str = Field(min_length=1)
    experiment: str = Field(min_length=1)
    max_restarts: int = Field(default=2, ge=0, le=100)
    min_workers: int | None = Field(default=None, ge=1, description="None: the world size")

    # Before the length check, so a blank source is rejected rather than stripped to "".
    @field_validator("source", mode="before")
    @classmethod
    def _strip(cls, value: object) -> object:
        return refuse_credentials(value.strip() if isinstance(value, str) else value)


class SweepParams(BaseModel):
    """The sweep's parameters. Trials (grid or list, exactly one) are checked per trial by
    ddpflow.sweep, so one bad trial is reported while the others run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(min_length=1)
    grid: dict[str, Any] | None = Field(default=None, description="field -> list of values")
    trials: list[Any] | None = Field(default=None, description="list of {field: value}")
    # Defaults for every trial field a grid or trial does not set; checked here so a bad
    # default fails the sweep up front instead of failing every trial.
    epochs: int = Field(ge=1, le=10_000)
    batch_size: int = Field(ge=1)
    lr: float = Field(gt=0, le=10)
    hidden_size: int = Field(ge=1, le=8192)
    num_layers: int = Field(ge=1, le=64)
    dropout: float = Field(ge=0, lt=1)
    seed: int = Field(ge=0)
    ranks_per_trial: int = Field(ge=1)
    holdout_fraction: float = Field(gt=0, lt=1)
    keep_last: int = Field(ge=1)
    rank_timeout_s: float = Field(gt=0)
    model_name: str = Field(min_length=1)
    experiment: str = Field(min_length=1)
    promote: bool

    @field_validator("source", mode="before")
    @classmethod
    def _strip(cls, value: object) -> object:
        return refuse_credentials(value.strip() if isinstance(value, str) else value)


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
    return f"{field}={error.get('input')!r}: {error['msg']}"


class ImageParams(BaseModel):
    """The image flow's parameters (train-images)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str | None = Field(default=None, description="None: the digits demo folder")
    arch: Literal["resnet18", "resnet50"]
    weights: str = Field(min_length=1, description="none, imagenet or a state_dict URI")
    freeze_backbone: bool
    image_size: int = Field(ge=8, le=1024)
    resize: Literal["crop", "stretch"]
    val_fraction: float = Field(gt=0, lt=1)
    epochs: int = Field(ge=1, le=10_000)
    batch_size: int = Field(ge=1, description="images per rank per step")
    lr: float = Field(gt=0, le=10, description="base lr, multiplied by world_size")
    optimizer: Literal["adam", "sgd"]
    lr_patience: int = Field(ge=0)
    world_size: int | None = Field(default=None, ge=1, description="None: every worker")
    seed: int = Field(ge=0)
    max_bad_fraction: float = Field(ge=0, lt=1)
    keep_last: int = Field(ge=1)
    rank_timeout_s: float = Field(gt=0)
    max_restarts: int = Field(default=2, ge=0, le=100)
    model_name: str = Field(min_length=1)
    experiment: str = Field(min_length=1)

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
