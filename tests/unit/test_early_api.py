"""When a flow's command line starts its embedded Prefect API early
(ddpflow/integrations/prefect/early_api.py)."""

from __future__ import annotations

import pytest

from ddpflow.integrations.prefect.early_api import wanted


@pytest.mark.parametrize(
    "args", [[], ["--epochs", "1"], ["--grid", "{}"], ["--world-sizes", "1,2"]]
)
def test_a_flow_command_line_without_an_api_starts_one_early(args):
    assert wanted(args, {})


@pytest.mark.parametrize(
    "args, environ",
    [
        ([], {"PREFECT_API_URL": "http://api:4200/api"}),
        (["--help"], {}),
        (["--epochs", "1", "-h"], {}),
    ],
)
def test_a_configured_server_or_help_starts_nothing(args, environ):
    assert not wanted(args, environ)
