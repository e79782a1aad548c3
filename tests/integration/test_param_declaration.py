"""Every flow parameter is declared once (type, limits and help in flows/params.py, the
default in flows/defaults.py) and the flow signatures, Prefect's parameter schema, the
command line, the sweep's trial checks, the docs tables and the deployment file agree with
that declaration."""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any, get_type_hints

import pytest
import yaml

from ddpflow.param_types import bounds_of
from ddpflow.workloads.sweep.config import TrialConfig, validate_trial
from flows import defaults, param_docs
from flows.cli import run_cli
from flows.param_flow import FlowParameters, declared, wire_type
from flows.params import (
    FIXES,
    CharLMParams,
    ImageParams,
    ParameterError,
    RetrainParams,
    ScalingParams,
    SweepParams,
    validate_params,
)
from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration

FLOWS = param_docs.flows()
FLOW_DEFAULTS = {
    "train-charlm": defaults.TRAIN_CHARLM,
    "retrain-charlm": defaults.RETRAIN_CHARLM,
    "sweep-charlm": defaults.SWEEP_CHARLM,
    "train-images": defaults.TRAIN_IMAGES,
    "scaling-charlm": defaults.SCALING_CHARLM,
    "scaling-images": defaults.SCALING_IMAGES,
}


def test_every_flow_with_parameters_is_covered() -> None:
    assert set(FLOWS) == set(FLOW_DEFAULTS)


@pytest.mark.parametrize("name", sorted(FLOW_DEFAULTS))
def test_the_signature_is_the_declaration(name: str) -> None:
    flow = FLOWS[name]
    parameters = declared(flow)
    assert parameters.defaults is FLOW_DEFAULTS[name], "the defaults of flows/defaults.py"
    signature = inspect.signature(flow)
    assert list(signature.parameters) == list(parameters.defaults)
    hints = get_type_hints(flow.fn)
    for param in signature.parameters.values():
        info = parameters.fields[param.name]
        assert param.default == parameters.defaults[param.name]
        assert hints[param.name] == param.annotation == wire_type(info.annotation)


@pytest.mark.parametrize("name", sorted(FLOW_DEFAULTS))
def test_prefect_schema_has_each_default_type_and_description(name: str) -> None:
    flow = FLOWS[name]
    parameters = declared(flow)
    schema = flow.parameters.model_dump_for_openapi()
    assert list(schema["properties"]) == list(parameters.defaults)
    assert "required" not in schema, "every flow parameter has a default"
    for field, prop in schema["properties"].items():
        assert prop["default"] == parameters.defaults[field], field
        assert prop["description"] == parameters.help(field)
        assert prop["description"].startswith(parameters.fields[field].description)


def test_help_carries_the_declared_limits() -> None:
    parameters = declared(FLOWS["train-charlm"])
    assert parameters.help("epochs") == "passes over the training data [1 to 10000]"
    assert parameters.help("lr") == "Adam learning rate [> 0, <= 10]"
    assert parameters.help("precision").endswith("[auto, fp32, bf16, fp16]")
    assert parameters.help("pin_memory").endswith("[auto, true, false]")


@pytest.mark.parametrize("name", sorted(FLOW_DEFAULTS))
def test_the_defaults_pass_the_flows_own_checks(name: str) -> None:
    declared(FLOWS[name]).check({})  # raises ParameterError if a default broke a bound


@pytest.mark.parametrize(
    ("model", "flow_defaults"),
    [(CharLMParams, defaults.TRAIN_CHARLM), (ImageParams, defaults.TRAIN_IMAGES)],
)
def test_a_default_kept_on_a_model_is_the_flows(model, flow_defaults) -> None:
    for name, info in model.model_fields.items():
        if not info.is_required():
            assert info.default == flow_defaults[name], name


def test_the_command_line_shows_the_declared_help(capsys) -> None:
    with pytest.raises(SystemExit):
        run_cli(FLOWS["sweep-charlm"], ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--hidden-size HIDDEN_SIZE LSTM units per layer [1 to 8192]; default: 128" in text
    assert "--ranks-per-trial RANKS_PER_TRIAL DDP ranks (Dask workers) of each trial" in text


def test_a_flow_without_a_declared_parameter_is_refused() -> None:
    with pytest.raises(TypeError, match="'epoch' is not declared"):
        FlowParameters({"epoch": 3}, (CharLMParams,))


def test_the_flow_function_gets_the_validated_model() -> None:
    flow = FLOWS["scaling-charlm"]
    with pytest.raises(ParameterError, match=r"epochs=0: .*; pass an integer from 1 to"):
        flow.fn(epochs=0)


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
    sweep = dict(defaults.SWEEP_CHARLM, grid={"lr": [0.1]}, model_name="m", experiment="e")
    trial = {k: sweep[k] for k in TRIAL_FIELDS}
    assert validate_trial(0, {**trial, field: inside}).valid
    validate_params(SweepParams, {**sweep, field: inside})
    assert not validate_trial(0, {**trial, field: outside}).valid
    with pytest.raises(ParameterError, match=f"{field}={outside!r}"):
        validate_params(SweepParams, {**sweep, field: outside})


def test_the_docs_tables_are_generated_from_the_declaration() -> None:
    stale = param_docs.stale(write=False)
    assert stale == [], f"run `python -m flows.param_docs`: {stale}"
    text = (REPO / "docs" / "charlm.md").read_text()
    assert param_docs.table(FLOWS["train-charlm"]) in text


@pytest.mark.parametrize(
    ("planted", "found"),
    [
        ("| `epochs` | int | `3` |", "| `epochs` | int | `4` |"),  # a default, in the docs only
        ("| 1 to 8192 |", "| 1 to 4096 |"),  # a bound
        ("| `keep_last` |", "| `keep_lastt` |"),  # a name
    ],
)
def test_a_planted_docs_drift_is_caught(planted: str, found: str) -> None:
    tables = {name: param_docs.table(flow) for name, flow in FLOWS.items()}
    fresh = param_docs.render((REPO / "docs" / "charlm.md").read_text(), tables)
    assert planted in fresh
    drifted = fresh.replace(planted, found, 1)
    assert param_docs.render(drifted, tables) == fresh != drifted


def _deployments() -> list[dict[str, Any]]:
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    return spec["deployments"]


def _flow_of(entry: dict[str, Any]):
    module, function = entry["entrypoint"].split(":")
    return getattr(importlib.import_module(module), function)


@pytest.mark.parametrize("entry", _deployments(), ids=lambda e: e["name"])
def test_deployment_parameters_are_declared_valid_and_not_copies(entry) -> None:
    flow = _flow_of(entry)
    parameters = declared(flow)
    given = entry.get("parameters") or {}
    assert set(given) <= set(parameters.defaults), "names the flow declares"
    parameters.check(dict(given))  # within the declared limits (ParameterError otherwise)
    copies = {k: v for k, v in given.items() if parameters.defaults[k] == v}
    assert copies == {}, "a deployment states only what differs from the flow's defaults"


MODELS = (CharLMParams, ImageParams, SweepParams, ScalingParams, RetrainParams)


@pytest.mark.parametrize("field", sorted(FIXES))
def test_each_fix_quotes_the_declared_bounds(field: str) -> None:
    # The fixes are prose ("pass an integer from 1 to 8192, e.g. 128"); a changed bound must
    # change its fix too. "positive" stands for a lower bound of 1 (or above 0).
    fix = FIXES[field].replace(",", "")
    declared_in = [m.model_fields[field] for m in MODELS if field in m.model_fields]
    assert declared_in, f"a fix for {field}, which no model declares"
    for info in declared_in:
        for kind, bound in bounds_of(info).items():
            positive = (kind, bound) in (("ge", 1), ("gt", 0)) and "positive" in fix
            shown = str(bound) if isinstance(bound, int) else f"{bound:g}"
            assert positive or shown in fix, (field, kind, bound)


def _entrypoints() -> list[str]:
    spec = yaml.safe_load((REPO / "examples" / "prefect.yaml").read_text())
    return [e["entrypoint"] for e in _deployments() + spec["deployments"]]


@pytest.mark.parametrize("entrypoint", _entrypoints())
def test_a_deployed_flow_unpickles_in_a_process_that_did_not_load_it(entrypoint) -> None:
    """A task submitted to Dask pickles the flow run's context, the flow included, and the
    scheduler must unpickle it. The deployments name their flows by module
    (`flows.train_images:train_images`), so what the flow's body refers to pickles by that
    module's name. Loaded from a file path instead (`flows/train_images.py:...`), the flow
    lived in a module named "train_images" that no other process has: functions of that
    file failed to unpickle there ("No module named 'train_images'")."""
    import subprocess
    import sys

    import cloudpickle
    from prefect.flows import load_flow_from_entrypoint

    assert ".py:" not in entrypoint, "a module path, not a file path"
    flow = load_flow_from_entrypoint(entrypoint)
    result = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=cloudpickle.dumps(flow),
        capture_output=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
