"""Every flow parameter is declared once, in the flow's parameter model (flows/params.py,
shared types in ddpflow/param_types.py), and Prefect's validation and parameter schema, the
command line and the docs tables (both made from that schema), the sweep's trial checks and
the deployment file agree with that declaration."""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any, get_type_hints

import prefect
import pytest
import yaml
from prefect.exceptions import ParameterTypeError

from ddpflow.param_types import bounds_of
from ddpflow.workloads.sweep.config import TrialConfig, validate_trial
from flows import param_docs
from flows.cli import run_cli
from flows.params import (
    CharLMParams,
    CharLMScalingParams,
    ImageParams,
    ImageScalingParams,
    ImageSweepParams,
    ParameterError,
    RetrainParams,
    SweepParams,
    validate_params,
)
from tests.helpers.paths import CHECKOUT

pytestmark = pytest.mark.integration

FLOWS = param_docs.flows()
FLOW_MODELS = {
    "train-charlm": ("training", CharLMParams),
    "retrain-charlm": ("training", RetrainParams),
    "sweep-charlm": ("sweep", SweepParams),
    "train-images": ("training", ImageParams),
    "sweep-images": ("sweep", ImageSweepParams),
    "scaling-charlm": ("scaling", CharLMScalingParams),
    "scaling-images": ("scaling", ImageScalingParams),
}


def test_every_flow_with_parameters_is_covered() -> None:
    assert set(FLOWS) == set(FLOW_MODELS)


@pytest.mark.parametrize("name", sorted(FLOW_MODELS))
def test_a_flow_is_prefects_own_and_takes_its_model(name: str) -> None:
    flow = FLOWS[name]
    assert type(flow) is prefect.Flow, "no subclass overriding Prefect's internals"
    parameter, model = FLOW_MODELS[name]
    [declared] = inspect.signature(flow.fn).parameters.values()
    assert (declared.name, get_type_hints(flow.fn)[declared.name]) == (parameter, model)
    assert declared.default == model(), "the model's own defaults"


@pytest.mark.parametrize("name", sorted(FLOW_MODELS))
def test_prefect_schema_has_each_field_default_limits_and_description(name: str) -> None:
    flow = FLOWS[name]
    parameter, model = FLOW_MODELS[name]
    schema = flow.parameters.model_dump_for_openapi()
    assert list(schema["properties"]) == [parameter]
    fields = schema["definitions"][model.__name__]["properties"]
    assert list(fields) == list(model.model_fields)
    for field, info in model.model_fields.items():
        assert fields[field]["default"] == info.default, field
        assert fields[field]["description"] == info.description, field
    assert (fields["epochs"]["minimum"], fields["epochs"]["maximum"]) == (1, 10_000)


def test_help_carries_the_declared_limits() -> None:
    name, model, fields = param_docs.parameter(FLOWS["train-charlm"])
    assert (name, model, list(fields)) == (
        "training",
        "CharLMParams",
        list(CharLMParams.model_fields),
    )
    assert param_docs.field_help(fields["epochs"]) == "passes over the training data [1 to 10000]"
    assert param_docs.field_help(fields["lr"]) == "Adam learning rate [> 0, <= 10]"
    assert param_docs.field_help(fields["precision"]).endswith("[auto, fp32, bf16, fp16]")
    assert param_docs.field_help(fields["pin_memory"]).endswith("[auto, true, false]")
    assert param_docs.field_help(fields["rank_timeout_s"]).endswith("[> 0, <= 604800]")
    assert param_docs.field_help(fields["source"]).endswith("[not empty]")
    assert param_docs.field_help(fields["compile"]) == "torch.compile the DDP model"


@pytest.mark.parametrize("name", sorted(FLOW_MODELS))
def test_the_defaults_pass_the_flows_own_checks(name: str) -> None:
    _, model = FLOW_MODELS[name]
    # pydantic does not check defaults: check them as if a user had passed each one.
    validate_params(model, model().model_dump())


def test_a_sweep_trial_defaults_to_what_train_charlm_trains_with() -> None:
    for field in ("epochs", "batch_size", "lr", "hidden_size", "num_layers", "dropout", "seed"):
        assert SweepParams().model_dump()[field] == CharLMParams().model_dump()[field], field


def test_a_scaling_run_trains_with_train_charlms_defaults_but_keeps_one_checkpoint() -> None:
    scaling, training = CharLMScalingParams(), CharLMParams()
    differ = {k for k, v in scaling.model_dump().items() if getattr(training, k, v) != v}
    assert differ == {"keep_last", "experiment"}


def test_the_command_line_shows_the_declared_help(capsys) -> None:
    with pytest.raises(SystemExit):
        run_cli(FLOWS["sweep-charlm"], ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--hidden-size HIDDEN_SIZE LSTM units per layer [1 to 8192]; default: 128" in text
    assert "--ranks-per-trial RANKS_PER_TRIAL DDP ranks (Dask workers) of each trial" in text


def test_prefect_refuses_a_flow_call_with_the_models_explanation() -> None:
    flow = FLOWS["scaling-charlm"]
    refused = r"epochs=0: Input should be greater than or equal to 1; grid='\{': "
    with pytest.raises(ParameterTypeError, match=refused):
        FLOWS["sweep-charlm"].validate_parameters({"sweep": {"epochs": 0, "grid": "{"}})
    with pytest.raises(ParameterTypeError, match=r"epochs=0: Input should be greater than or eq"):
        flow.validate_parameters({"scaling": {"epochs": 0}})
    checked = flow.validate_parameters({"scaling": {"epochs": "2", "compile": "false"}})
    assert checked["scaling"] == CharLMScalingParams(epochs=2)


# The trial fields: one annotated type each, shared by the sweep's trial check, the sweep's
# own defaults and the training flows.
TRIAL_FIELDS = list(get_type_hints(TrialConfig))


@pytest.mark.parametrize("field", TRIAL_FIELDS)
def test_a_trial_field_has_the_flows_bounds(field: str) -> None:
    hint = get_type_hints(TrialConfig, include_extras=True)[field]
    trial_metadata = [m for info in typing.get_args(hint)[1:] for m in info.metadata]
    for model in (SweepParams, CharLMParams):
        assert model.model_fields[field].metadata == trial_metadata, (model, field)


@pytest.mark.parametrize(
    ("field", "inside", "outside"),
    [
        ("epochs", 10_000, 10_001),
        ("batch_size", 1, 0),
        ("lr", 10, 10.5),
        ("hidden_size", 8192, 8193),
        ("num_layers", 1, 0),
        ("dropout", 0.0, 1.0),
        ("seed", 0, -1),
    ],
)
def test_trial_and_flow_accept_and_refuse_the_same_values(field, inside, outside) -> None:
    sweep = dict(SweepParams().model_dump(), grid={"lr": [0.1]}, model_name="m", experiment="e")
    trial = {k: sweep[k] for k in TRIAL_FIELDS}
    assert validate_trial(0, {**trial, field: inside}).valid
    validate_params(SweepParams, {**sweep, field: inside})
    assert not validate_trial(0, {**trial, field: outside}).valid
    with pytest.raises(ParameterError, match=f"{field}={outside!r}"):
        validate_params(SweepParams, {**sweep, field: outside})


def test_the_docs_tables_are_generated_from_the_declaration() -> None:
    stale = param_docs.stale(write=False)
    assert stale == [], f"run `python -m flows.param_docs`: {stale}"
    text = (CHECKOUT / "docs" / "charlm.md").read_text()
    assert param_docs.table(FLOWS["train-charlm"]) in text


@pytest.mark.parametrize(
    ("planted", "found"),
    [
        ("| `epochs` | integer | `3` |", "| `epochs` | integer | `4` |"),  # a default, docs only
        ("| 1 to 8192 |", "| 1 to 4096 |"),  # a bound
        ("| `keep_last` |", "| `keep_lastt` |"),  # a name
    ],
)
def test_a_planted_docs_drift_is_caught(planted: str, found: str) -> None:
    tables = {name: param_docs.table(flow) for name, flow in FLOWS.items()}
    fresh = param_docs.render((CHECKOUT / "docs" / "charlm.md").read_text(), tables)
    assert planted in fresh
    drifted = fresh.replace(planted, found, 1)
    assert param_docs.render(drifted, tables) == fresh != drifted


def _deployments() -> list[dict[str, Any]]:
    spec = yaml.safe_load((CHECKOUT / "deployments" / "prefect.yaml").read_text())
    return spec["deployments"]


def _flow_of(entry: dict[str, Any]):
    module, function = entry["entrypoint"].split(":")
    return getattr(importlib.import_module(module), function)


@pytest.mark.parametrize("entry", _deployments(), ids=lambda e: e["name"])
def test_deployment_parameters_are_declared_valid_and_not_copies(entry) -> None:
    flow = _flow_of(entry)
    given = entry.get("parameters") or {}
    [(parameter, model)] = [FLOW_MODELS[flow.name]]
    assert set(given) <= {parameter}, "the flow's own parameter"
    flow.validate_parameters(given)  # Prefect's own check (ParameterTypeError otherwise)
    fields = given.get(parameter, {})
    copies = {k: v for k, v in fields.items() if model.model_fields[k].default == v}
    assert copies == {}, "a deployment states only what differs from the model's defaults"


MODELS = (CharLMParams, ImageParams, SweepParams, CharLMScalingParams, ImageScalingParams)
MODELS += (RetrainParams,)


# Each declared bound of each field, tested just outside it.
BOUNDED = sorted(
    {
        (m.__name__, f, kind)
        for m in MODELS
        for f, info in m.model_fields.items()
        for kind in bounds_of(info)
    }
)
PHRASES = {
    "ge": "greater than or equal to",
    "gt": "greater than",
    "le": "less than or equal to",
    "lt": "less than",
}


@pytest.mark.parametrize(("model_name", "field", "kind"), BOUNDED)
def test_a_value_out_of_bounds_is_refused_with_the_declared_bound(model_name, field, kind) -> None:
    # Pydantic's message states the broken bound, read from the declaration: a changed bound
    # changes what the refusal tells the user.
    model = next(m for m in MODELS if m.__name__ == model_name)
    bound = bounds_of(model.model_fields[field])[kind]
    value = {"ge": bound - 1, "gt": bound, "le": bound + 1, "lt": bound}[kind]
    with pytest.raises(ParameterError) as refused:
        validate_params(model, {field: value})
    shown = str(bound).removesuffix(".0")  # pydantic shows 256.0 as 256
    expected = f"{field}={value!r}: Input should be {PHRASES[kind]} {shown}"
    assert str(refused.value) == f"invalid flow parameters: {expected}"


def _entrypoints() -> list[str]:
    spec = yaml.safe_load((CHECKOUT / "examples" / "prefect.yaml").read_text())
    return [e["entrypoint"] for e in _deployments() + spec["deployments"]]


# One fresh interpreter unpickles every deployed flow, each on its own and reporting its own
# error: a flow pickled by a module name that no process has fails there whatever was loaded
# before it, and one interpreter instead of one per flow saves about 7 CPU-seconds a flow
# (its imports of torch, Prefect and the flows).
UNPICKLE_EACH = """
import json, pickle, sys
errors = {}
for entrypoint, data in pickle.loads(sys.stdin.buffer.read()).items():
    try:
        pickle.loads(data)
    except Exception as error:  # reported per flow by the test
        errors[entrypoint] = f"{type(error).__name__}: {error}"
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def unpickle_errors() -> dict[str, str]:
    """Each deployed flow's error when unpickled in a process that did not load it (none: it
    unpickled)."""
    import json
    import pickle
    import subprocess
    import sys

    import cloudpickle
    from prefect.flows import load_flow_from_entrypoint

    pickles = {e: cloudpickle.dumps(load_flow_from_entrypoint(e)) for e in _entrypoints()}
    result = subprocess.run(
        [sys.executable, "-c", UNPICKLE_EACH],
        input=pickle.dumps(pickles),
        capture_output=True,
        cwd=CHECKOUT,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("entrypoint", _entrypoints())
def test_a_deployed_flow_unpickles_in_a_process_that_did_not_load_it(
    entrypoint: str, unpickle_errors: dict[str, str]
) -> None:
    """A task submitted to Dask pickles the flow run's context, the flow included, and the
    scheduler must unpickle it. The deployments name their flows by module
    (`flows.train_images:train_images`), so what the flow's body refers to pickles by that
    module's name. Loaded from a file path instead (`flows/train_images.py:...`), the flow
    lived in a module named "train_images" that no other process has: functions of that
    file failed to unpickle there ("No module named 'train_images'")."""
    assert ".py:" not in entrypoint, "a module path, not a file path"
    assert entrypoint not in unpickle_errors, unpickle_errors[entrypoint]
