"""How a training flow run ends, as the person watching it should read it.

Prefect would paint a refused double click and a cancel from the UI alike: red, with a traceback or
"Finished in state Running()". Here a flow's body runs through `run_or_end`, which turns
- a refusal (another flow run holds the run name) into the state *Refused* (of type Cancelled, grey),
  with the one-line reason as its message;
- a stop (Prefect's SIGTERM: *Cancel* in the UI, or `tessera up` shutting down) into *Cancelled*, with
  what stopped it and what is left, once the body has stopped the trainer and closed the MLflow run.
The flow process proposes that state itself, so the UI shows it as soon as the trainer is gone
instead of when the worker gets round to it.

Form values are validated here too, first thing in the flow, in one line: a run started from the UI
with its *Validate parameters* switch off still gets the form's bounds checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn, TypeVar

from pydantic import BaseModel, ValidationError

from tasks.recipe import RecipeError

REFUSED = "Refused"
STOPPED_BY_UP = "stopped by `tessera up` shutting down"

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def form_values(model: type[M], raw: object) -> M:
    """The flow's parameter model from what the form sent; a bad value is one line naming the field and its bounds."""
    if isinstance(raw, model):
        return raw
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        field = model.model_fields.get(str(loc[0])) if loc else None
        name = ".".join(str(p) for p in loc) or "params"
        value = f" {err['input']!r}" if loc and not isinstance(err.get("input"), dict) else ""
        hint = f" ({field.description})" if field and field.description else ""
        raise RecipeError(f"form field {name}{value}: {err['msg']}{hint}") from None


def _stop_reason() -> str:
    """Why the flow run is being stopped: the message of its Cancelling state, when someone gave one."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
    except Exception:  # noqa: BLE001 - the reason is a nicety; the stop goes ahead without it
        return ""
    return (state.message or "") if state is not None and state.is_cancelling() else ""


def _end_as(state) -> NoReturn:
    """End this flow run in `state` now, without the engine's error log.

    Returning a Cancelled state from the flow would do, except that Prefect's engine then raises it as
    CancelledRun and logs "Engine execution exited with unexpected exception" with a traceback, red in
    the run's log, and the flow process exits 1. So the state is set through the API, and the engine is
    told the run is over the way the API itself tells it: Abort, carrying that state, which the engine
    reports as the run's final state and exits 0 on.
    """
    from prefect.exceptions import Abort
    from prefect.runtime import flow_run

    from tasks.runs.last_word import set_state

    result = set_state(flow_run.id, state)  # retried: a server slow or locked for seconds must not lose it
    signal = Abort(state.message)
    signal.state = result.state or state  # the engine's "Finished in state ..." and its outcome report
    raise signal


def run_or_end(run_name: str, body: Callable[[], T], stays: Callable[[], str] | None = None) -> T:
    """`body()`'s result; a refusal or a stop ends the flow run in the state that says so instead. `stays` says
    what a stopped run keeps (tasks/training/train.what_stays), read once the trainer is gone."""
    from prefect.exceptions import TerminationSignal
    from prefect.states import Cancelled

    from tasks.runs.run_slot import RunBusy

    try:
        return body()
    except RunBusy as exc:
        _end_as(Cancelled(name=REFUSED, message=str(exc)))
    except Exception as exc:
        if not _stopping(exc):
            raise
        # Prefect raises the stop in the main thread wherever it is; landing inside a lock's release it can come
        # out as "RuntimeError: release unlocked lock" with the stop as its context (CI at 2d8ddb8: the cancelled
        # run then ended Failed and lost its explanation). It is still the stop.
        logging.getLogger("tessera.flow").debug("an error while the flow run was being stopped", exc_info=True)
        _end_stopped(run_name, stays)
    except TerminationSignal:
        _end_stopped(run_name, stays)


def _stopping(exc: BaseException) -> bool:
    """Whether `exc` was raised while a stop (Prefect's TerminationSignal) was unwinding the flow."""
    return stop_signal(exc) is not None


def stop_signal(exc: BaseException) -> int | None:
    """The signal of the stop (Prefect's TerminationSignal) that `exc` was raised while unwinding, if any."""
    from prefect.exceptions import TerminationSignal

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, TerminationSignal):
            return int(exc.signal)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _end_stopped(run_name: str, stays: Callable[[], str] | None) -> NoReturn:
    from prefect.states import Cancelled

    why = _stop_reason() or "cancelled"
    kept = "a rerun of the same run name resumes from its newest checkpoint"
    if stays is not None:
        try:
            kept = stays()
        except Exception:  # noqa: BLE001 - the explanation is written whatever; the general line is still true
            pass
    _end_as(Cancelled(message=f"{why}: every rank of run {run_name!r} was stopped; {kept}"))


def keep_last_word(flow_run_id) -> None:
    """From an on_cancellation hook: keep the explanation this flow run ended with as its last state, over the
    Cancelled Prefect's runner writes after the hooks (tasks/runs/last_word.py)."""
    from tasks.runs.last_word import spawn

    spawn(flow_run_id)


def ended_message(exc: BaseException) -> tuple[str, bool] | None:
    """For the CLI: (message, refused) when `exc` is a flow run ending as run_or_end ends it, else None."""
    from prefect.exceptions import Abort

    state = getattr(exc, "state", None) if isinstance(exc, Abort) else None
    if state is None:
        return None
    return state.message or str(exc), state.name == REFUSED
