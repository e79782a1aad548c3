"""The local stack's Prefect and MLflow UIs in headless Chromium, opened as a user opens them.

The session's stack (`start_stack(free_ports=True)`, `make stack-up ARGS="--free-ports"`;
tests/integration/conftest.py's local_stack), one 1-epoch pet-name
training against it (`python -m flows.train_charlm` with the stack's env.sh, as a user runs
it), then the browser: the URLs and the login that `up` prints (the docs say the same), the
Prefect UI's flow-run page and the MLflow run page with the run's name and metrics, not a
login, 404 or "Can't connect" page. Chromium is driven over the DevTools protocol
(tests/helpers/browser.py): MLflow's basic auth is answered as a user answers the
browser's dialog, and the Prefect UI's login form is typed into.

The training is made once for the module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from infra import stack
from infra.state import WORK_POOL, StackState
from tests.helpers.browser import Page, chromium, open_browser
from tests.helpers.projects import run_flow, tiny_charlm

pytestmark = [pytest.mark.integration, pytest.mark.browser]

EXPERIMENT = "stack-uis"
MODEL = "stack-uis-model"
# What the UIs show instead of a page: Prefect's toasts, login errors and 404 (a UI that calls
# another port than its server's refuses the right auth string as "Invalid credentials"),
# MLflow's basic-auth refusal.
PREFECT_ERRORS = (
    "Can't connect to Server API", "Authentication failed", "Invalid credentials",
    "Invalid password", "Page not found",
)  # fmt: skip
MLFLOW_REFUSAL = "You are not authenticated"


@dataclass(frozen=True)
class StackRun:
    state: StackState
    printed: str  # what `stack up` printed
    flow_output: str  # what `python -m flows.train_charlm` printed and logged
    run: Run  # the training's MLflow run

    def ui_line(self, name: str) -> str:
        (line,) = [row for row in self.printed.splitlines() if row.strip().startswith(name)]
        return line

    def ui_url(self, name: str) -> str:
        found = re.search(r"https?://\S+", self.ui_line(name))
        assert found, self.ui_line(name)
        return found.group(0)


@pytest.fixture(scope="module")
def stack_run(local_stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> StackRun:
    chromium()  # skip (or fail on CI) before the training costs a minute
    state = local_stack
    project = tmp_path_factory.mktemp("project")
    # An experiment and a model of its own: the deployments' runs share the stack.
    options = tiny_charlm(1, experiment=EXPERIMENT, model_name=MODEL)
    done = run_flow("train_charlm", options, project, timeout_s=400, env=state.env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    with pytest.MonkeyPatch.context() as patch:
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            patch.setenv(key, state.env[key])
        client = MlflowClient(state.env["MLFLOW_TRACKING_URI"])
        experiment = client.get_experiment_by_name(EXPERIMENT)
        (run,) = client.search_runs([experiment.experiment_id])
    return StackRun(state, stack.summary(state), done.stdout + done.stderr, run)


@pytest.fixture
def browser_dir(tmp_path: Path) -> Path:
    """The browser's profile (fresh per test: nobody is logged in) and its screenshots."""
    return tmp_path


def test_up_prints_each_ui_and_how_to_log_in(stack_run: StackRun) -> None:
    env = stack_run.state.env
    assert stack_run.ui_url("Prefect UI") == env["PREFECT_API_URL"].removesuffix("/api")
    assert "$PREFECT_API_AUTH_STRING" in stack_run.ui_line("Prefect UI")
    mlflow = stack_run.ui_line("MLflow UI")
    assert stack_run.ui_url("MLflow UI") == env["MLFLOW_TRACKING_URI"]
    assert f"user {env['MLFLOW_TRACKING_USERNAME']}" in mlflow
    assert "$MLFLOW_TRACKING_PASSWORD" in mlflow
    env_sh = stack_run.state.env_path.read_text()
    for key in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        assert f"export {key}=" in env_sh


def test_prefect_ui_shows_the_flow_run_after_the_login(stack_run: StackRun, browser_dir: Path):
    """The flow run's link that ddpflow wrote into the MLflow run's description, opened in a
    fresh browser: the UI's login form, the auth string from env.sh, then the flow run's
    page; then the UI's URL that `up` printed, without a second login."""
    run = stack_run.run
    env = stack_run.state.env
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    link = f"{env['PREFECT_UI_URL']}/runs/flow-run/{flow_run_id}"
    assert link in re.findall(r"https?://[^\s)\]]+", run.data.tags["mlflow.note.content"])

    with open_browser(browser_dir / "profile", shots=browser_dir) as page:
        page.goto(link)
        page.wait_for_element("input[type=password]")  # the UI asks for the auth string
        page.fill("input[type=password]", env["PREFECT_API_AUTH_STRING"])
        page.click("button[type=submit]")
        shown = _shows_prefect_page(page, run.info.run_name, "train-charlm", "Completed")
        assert "epoch 1/1 done" in shown, shown[:3000]  # the flow run's logs, from the API
        assert flow_run_id in page.url(), page.url()
        page.screenshot(browser_dir / "prefect-flow-run.png")
        page.goto(stack_run.ui_url("Prefect UI"))  # the dashboard, with the API's records
        _shows_prefect_page(page, "Flow Runs", "Active Work Pools", WORK_POOL)


def test_mlflow_ui_shows_the_run_of_the_summary_link_after_the_login(
    stack_run: StackRun, browser_dir: Path
):
    """The MLflow link the flow's summary printed: the browser's basic-auth dialog, dismissed
    first, then answered with the user and the password from env.sh that `up` names; the
    run's page with its metrics."""
    run = stack_run.run
    env = stack_run.state.env
    mlflow = stack_run.ui_url("MLflow UI")
    link = _summary_link(stack_run)
    with open_browser(browser_dir / "profile", shots=browser_dir) as page:
        page.goto(link)  # no login yet: the dialog is dismissed
        page.wait_for_text(MLFLOW_REFUSAL)
        assert page.challenges == [mlflow]
        page.logins[mlflow] = (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"])
        page.reload()
        page.wait_for_text(
            run.info.run_name, "Model metrics", "final_val_loss", refuse=[MLFLOW_REFUSAL]
        )
        page.screenshot(browser_dir / "mlflow-run.png")


def test_the_summary_link_opens_the_model_training_view(stack_run: StackRun, browser_dir: Path):
    """In a fresh browser, the MLflow UI opens a link without `workflowType=machine_learning`
    in its GenAI view (docs/inspecting.md): the summary's link must keep the query through
    MLflow's redirects, so that the page comes with the Model training view's sidebar."""
    env = stack_run.state.env
    login = (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"])
    logins = {stack_run.ui_url("MLflow UI"): login}
    with open_browser(browser_dir / "profile", logins, shots=browser_dir) as page:
        page.goto(_summary_link(stack_run))
        shown = page.wait_for_text(stack_run.run.info.run_name, "Model metrics")
        view = {"url": page.url(), "Model registry": "Model registry" in shown}
        view["Evaluation runs"] = "Evaluation runs" in shown  # GenAI's sidebar
        if not view["Model registry"] or view["Evaluation runs"]:
            page.screenshot(browser_dir / "mlflow-view.png")
        assert "workflowType=machine_learning" in view["url"], view
        assert view["Model registry"] and not view["Evaluation runs"], view


def _summary_link(stack_run: StackRun) -> str:
    """The MLflow link in the flow's summary (`MLflow UI  open <link>`)."""
    printed = re.search(r"MLflow UI\s+open (\S+)", stack_run.flow_output)
    assert printed, stack_run.flow_output[-3000:]
    link = printed.group(1)
    assert link.startswith(stack_run.ui_url("MLflow UI") + "/"), link
    assert stack_run.run.info.run_id in link, link
    return link


def _shows_prefect_page(page: Page, *needles: str) -> str:
    """The page's text once it shows `needles`, with none of the UI's error messages."""
    shown = page.wait_for_text(*needles, refuse=PREFECT_ERRORS)
    page.pump(2)  # a failed API call's toast comes a moment after the page
    shown = page.text()
    errors = [error for error in PREFECT_ERRORS if error in shown]
    assert errors == [], f"{page.url()} shows {errors}:\n{shown[:3000]}"
    return shown
