"""What a person sees: the Prefect and MLflow UIs of `tessera up`, clicked through in a real headless browser.

Debian's Chromium (`apt-get install chromium`) driven by Playwright (`executable_path`, no browser
download), against the session's live stack (tests/conftest.py: live_stack). One person's first hour:
fill the pretrain form, watch the run named after the run, cancel it, start it again and read where it
resumed, click Run a second time and read the refusal, then open the MLflow run and the registry.

Marked `ui` and left out of `make test` (Chromium is an apt package, not a pip one): `make test-ui`
runs them. Each step saves a screenshot under TESSERA_UI_SHOTS (default: a temporary folder); the
README's screenshots in docs/images/ come from such a run.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tasks.recipe import load_recipe
from tests.conftest import prefect_api

pytestmark = [pytest.mark.slow, pytest.mark.ui]

CHROMIUM = os.environ.get("TESSERA_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Chromium as root in a container, without the background traffic a closed network refuses
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
RUN = "ui-form"
# literary long enough (96 steps) that the cancel, clicked once its first checkpoint exists, lands mid-stage on a
# quiet machine too (at 24 steps the stage had ended before the click, and the rerun had nothing to resume)
BUDGETS = [("literary", "98304"), ("stories", "8192")]


def field(page, label: str, tag: str = "input"):
    """The input of the form property whose label starts with `label` (the Prefect form has no for= ids)."""
    prop = "contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')"
    return page.locator(
        f"xpath=//span[contains(@class,'schema-form-property__label')]"
        f"[starts-with(normalize-space(), '{label}')]/ancestor::div[{prop}][1]//{tag}"
    )


class Person:
    """A browser page and the stack it looks at; `shot` keeps a screenshot of what it sees."""

    def __init__(self, page, stack, shots: Path):
        self.page, self.stack, self.shots = page, stack, shots

    def shot(self, name: str, showing: str | re.Pattern | None = None) -> Path:
        """A screenshot; `showing` scrolls that text into view first (the run page scrolls its log inside)."""
        if showing is not None:
            self.page.get_by_text(showing).first.scroll_into_view_if_needed()
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def see(self, text: str | re.Pattern, timeout_s: float = 300) -> None:
        """Until `text` is on the page (the Prefect UI polls its API; nothing is reloaded by hand)."""
        self.page.get_by_text(text).first.wait_for(state="visible", timeout=timeout_s * 1000)

    def start_from_the_form(self, budgets: list[tuple[str, str]] | None = None, every: str | None = None) -> str:
        """Fill the pretrain deployment's form as a person would, submit it, open the run; returns its id."""
        deployment = prefect_api("GET", f"{self.stack.api_url}/deployments/name/pretrain_pipeline/pretrain").json()
        self.page.goto(f"{self.stack.ui_url}/deployments/deployment/{deployment['id']}/run")
        field(self.page, "Recipe", "textarea").first.wait_for(timeout=60_000)
        field(self.page, "Recipe", "textarea").first.fill(str(self.stack.recipe))
        field(self.page, "Run name", "textarea").first.fill(RUN)
        stages = [s.name for s in load_recipe(str(self.stack.recipe)).train.stages]
        for i, (stage, tokens) in enumerate(budgets or []):
            self.page.get_by_role("button", name="Add item").click()
            # *Stage* is a choice of the served recipe's stages (cli/forms.recipe_schema), picked as a person
            # does with the keyboard: the first arrow opens the list on its first stage
            choice = self.page.locator(".p-select-button__control").nth(i)
            choice.wait_for()
            self.page.wait_for_timeout(500)  # the new row renders twice as it is added
            choice.focus()
            for _ in range(stages.index(stage) + 1):
                self.page.keyboard.press("ArrowDown")
                self.page.wait_for_timeout(300)  # the list opens (and moves) with an animation
            self.page.keyboard.press("Enter")
            deadline = time.monotonic() + 10
            while choice.inner_text().strip() != stage:
                if time.monotonic() > deadline:
                    self.shot("stage-not-chosen")
                    pytest.fail(f"stage {stage!r} was not chosen: {choice.inner_text()!r}")
                self.page.wait_for_timeout(200)
            field(self.page, "Tokens").nth(i).fill(tokens)
        if every:
            field(self.page, "Checkpoint every").first.fill(every)
        if not (self.shots / "prefect-form.png").exists():
            self.shot("prefect-form")
        # the run the click created, from the UI's own request; then its page, as the toast's "View run" opens
        # (the toast's button itself keeps moving while it animates in, so a robot's click misses it)
        with self.page.expect_response(lambda r: r.url.endswith("/create_flow_run"), timeout=30_000) as created:
            self.page.get_by_role("button", name="Submit").click()
        body = created.value.json()
        assert created.value.status == 201, body  # the UI itself refused to create it
        run_id = body["id"]
        self.page.goto(f"{self.stack.ui_url}/runs/flow-run/{run_id}")
        return run_id

    def state(self, run_id: str) -> dict:
        return prefect_api("GET", f"{self.stack.api_url}/flow_runs/{run_id}").json()


def close_the_assistant(page) -> None:
    """MLflow 3.17 opens its chat panel over a third of the page; a person closes it once."""
    close = page.get_by_role("button", name="Close", exact=True)  # the panel's header, after New Chat and Settings
    if page.get_by_text("MLflow Assistant").count() and close.count():
        close.first.click()
        page.wait_for_timeout(500)


@pytest.fixture(scope="module")
def person(live_stack, tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the ui suite needs Playwright: `make test-ui`")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"the ui suite needs Chromium at {CHROMIUM}: `apt-get install chromium`")
    shots = Path(os.environ.get("TESSERA_UI_SHOTS") or tmp_path_factory.mktemp("ui-shots"))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1300})
        try:
            yield Person(page, live_stack, shots)
        finally:
            browser.close()


@pytest.fixture(scope="module")
def first_hour(person):
    """The walk through the UI; what each step showed, for the tests below."""
    from trainers.format.checkpoints import list_complete

    seen: dict = {}
    first = person.start_from_the_form(BUDGETS, every="8192")
    seen["first"] = first
    person.see(RUN)  # the flow run takes the run's name, not Prefect's random one
    person.see("stage literary: starting run ui-form fresh")
    person.see(re.compile(r"stage literary: [\d,]+/98,304 tokens \(\d+%\) at the run's step \d+"))
    seen["running"] = person.state(first)
    person.shot("prefect-running", showing=re.compile(r"stage literary: [\d,]+/98,304 tokens"))

    folder = person.stack.work_dir / "runs" / RUN / "checkpoints"
    deadline = time.monotonic() + 600
    while not list_complete(folder):
        assert time.monotonic() < deadline, "no checkpoint to resume from"
        time.sleep(1)
    person.page.get_by_role("button", name="Cancel").first.click()
    person.page.get_by_role("button", name="Confirm").click()
    person.see(re.compile(r"cancelled: every rank of run 'ui-form' was stopped"), timeout_s=120)
    seen["cancelled"] = person.state(first)
    # a minute on, after Prefect's worker has written its own Cancelled, the explanation is still what shows
    time.sleep(60)
    person.page.reload()
    person.see(re.compile(r"cancelled: every rank of run 'ui-form' was stopped; its checkpoint at [\d,]+ tokens"))
    seen["cancelled_later"] = person.state(first)
    person.shot("prefect-cancelled", showing=re.compile("every rank of run 'ui-form' was stopped"))

    # Run again, and click Run a second time straight after, as a double click would: one resumes, one is refused
    second = person.start_from_the_form(BUDGETS, every="8192")
    third = person.start_from_the_form(BUDGETS, every="8192")
    deadline = time.monotonic() + 300
    while "Refused" not in {person.state(r)["state"]["name"] for r in (second, third)}:
        assert time.monotonic() < deadline, "neither run was refused"
        time.sleep(1)
    refused, resumed = (second, third) if person.state(second)["state"]["name"] == "Refused" else (third, second)
    person.page.goto(f"{person.stack.ui_url}/runs/flow-run/{refused}")
    person.see(re.compile(r"run 'ui-form' is already running in flow run 'ui-form'"), timeout_s=60)
    seen["refused"] = person.state(refused)
    seen["refused_page"] = person.page.inner_text("body")
    person.shot("prefect-refused", showing=re.compile("is already running in flow run"))

    person.page.goto(f"{person.stack.ui_url}/runs/flow-run/{resumed}")
    person.see(re.compile(r"stage literary: resuming run ui-form from the checkpoint at [\d,]+ tokens"))
    seen["resumed_text"] = person.page.get_by_text(re.compile("resuming run ui-form from")).first.inner_text()
    person.shot("prefect-resumed", showing=re.compile("resuming run ui-form from"))
    deadline = time.monotonic() + 900
    while (done := person.state(resumed))["state"]["type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        assert time.monotonic() < deadline, "the resumed run did not finish"
        time.sleep(2)
    seen["resumed"] = done
    person.page.reload()
    person.see("Completed", timeout_s=60)
    person.shot("prefect-completed")
    return seen


def test_the_form_marks_bad_values_in_place_and_starts_nothing(person):
    """lr 5 and a checkpoint interval that is no multiple of a step, typed into the form and submitted: each field
    is marked red with its reason under it, and no flow run is created (before, the form passed them and only the
    server's refusal of the run said so, in a toast naming `params.lr`)."""
    deployment = prefect_api("GET", f"{person.stack.api_url}/deployments/name/pretrain_pipeline/pretrain").json()
    page = person.page
    page.goto(f"{person.stack.ui_url}/deployments/deployment/{deployment['id']}/run")
    field(page, "Recipe", "textarea").first.wait_for(timeout=60_000)
    field(page, "Peak learning rate").first.fill("5")
    field(page, "Checkpoint every").first.fill("1000")
    created = []
    page.on("request", lambda r: created.append(r.url) if r.url.endswith("/create_flow_run") else None)
    page.get_by_role("button", name="Submit").click()
    person.see("5 is greater than the maximum of 1", timeout_s=30)
    person.see(re.compile(r"1000 is not a multiple of \d+"), timeout_s=30)
    person.shot("prefect-form-refused", showing="5 is greater than the maximum of 1")
    page.wait_for_timeout(2000)  # a run the click created would have been requested by now
    assert created == []
    assert not page.get_by_text("Error creating flow run").count()


def test_the_form_starts_a_run_named_after_the_run(first_hour, person):
    running = first_hour["running"]
    assert running["name"] == RUN and f"run:{RUN}" in running["tags"]
    params = running["parameters"]["params"]
    assert params["run_name"] == RUN and params["eval_every"] == 8192
    assert params["stage_tokens"] == [{"stage": s, "tokens": int(t)} for s, t in BUDGETS]
    # fields left empty were not sent: the recipe's values stay
    assert not {"lr", "procs_per_node", "tracking_uri"} & set(params)


def test_cancel_shows_cancelled_with_what_stays(first_hour):
    state = first_hour["cancelled"]["state"]
    assert (state["type"], state["name"]) == ("CANCELLED", "Cancelled")
    assert re.search(
        r"; its checkpoint at [\d,]+ tokens \(step [\d,]+, stage literary\) stays, and a rerun", state["message"]
    )
    assert first_hour["cancelled_later"]["state"]["message"] == state["message"]


def test_the_rerun_says_where_it_resumed(first_hour):
    assert re.fullmatch(
        r"stage literary: resuming run ui-form from the checkpoint at [\d,]+ tokens \(step \d+\), "
        r"written \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC",
        first_hour["resumed_text"].strip(),
    )
    assert first_hour["resumed"]["state"]["type"] == "COMPLETED"


def test_a_second_click_reads_as_a_refusal(first_hour):
    state = first_hour["refused"]["state"]
    assert (state["type"], state["name"]) == ("CANCELLED", "Refused")
    assert "Refused" in first_hour["refused_page"] and "Failed" not in first_hour["refused_page"]
    assert "Traceback" not in first_hour["refused_page"]


def test_mlflow_shows_the_run_and_the_registry(first_hour, person):
    from mlflow.tracking import MlflowClient

    from tasks.mlflow_run import model_ui_url, run_ui_url
    from tasks.tracking_config import TrackingConfig

    client = MlflowClient(person.stack.mlflow_url, person.stack.mlflow_url)
    experiment = client.get_experiment_by_name("tessera-tiny")
    run = client.search_runs([experiment.experiment_id], f"tags.`tessera.run_name` = '{RUN}'")[0]
    tracking = TrackingConfig(tracking_uri=person.stack.mlflow_url, registered_model="tessera-tiny")
    # the link `tessera up` prints, then clicks: the experiment opens on its runs, not GenAI's usage page
    person.page.goto(f"{person.stack.mlflow_url}/tessera/model-training")
    person.see("tessera-tiny", timeout_s=60)
    close_the_assistant(person.page)
    person.page.get_by_role("link", name="tessera-tiny").first.click()
    person.see(RUN, timeout_s=60)
    assert "workflowType=genai" not in person.page.url and "/overview" not in person.page.url, person.page.url
    assert person.page.evaluate('window.localStorage.getItem("mlflow.workflowType_v1")') == '"machine_learning"'
    person.shot("mlflow-experiment-clicked")
    person.page.goto(run_ui_url(tracking, run.info.run_id, experiment.experiment_id))
    person.see(RUN, timeout_s=60)
    person.see("train/loss", timeout_s=60)
    close_the_assistant(person.page)
    person.shot("mlflow-run")
    person.page.goto(model_ui_url(tracking, "tessera-tiny"))
    person.see("Version 1", timeout_s=60)
    person.see("champion", timeout_s=60)
    close_the_assistant(person.page)
    person.shot("mlflow-registry")
