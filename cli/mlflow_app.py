"""The MLflow server `tessera up` runs: MLflow's own app, plus one page that opens it in model training.

MLflow 3.17's UI shows GenAI or model training by the page's `workflowType` parameter, else by the browser's last
choice, kept in its local storage (`mlflow.workflowType_v1`), GenAI when it has made none; an experiment's
`mlflow.experimentKind` tag no longer decides (its UI reads the kind from the workflow type). A link with the
parameter holds for one page only: the first click inside the UI drops it, and the browser falls back to GenAI
(the experiment's "Usage" page, Traces 0, no model registry in the sidebar). So `tessera up`'s link is this page,
served by the MLflow server on its own origin: it records model training as the browser's choice, as the UI's own
switch does, and opens the experiments; every click path after it stays there, and the switch still changes it.

MLflow loads it as an app plugin (`mlflow server --app-name tessera`, entry point group `mlflow.app`), the way
it loads its own basic-auth app: a factory that returns the ASGI app uvicorn serves.
"""

from __future__ import annotations

MODEL_TRAINING_PAGE = "/tessera/model-training"
STORAGE_KEY = "mlflow.workflowType_v1"  # the UI's useLocalStorage key for "mlflow.workflowType", version 1

_PAGE = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>MLflow: model training</title></head>
<body><p>Opening MLflow in model training...</p>
<script>
try {{ window.localStorage.setItem("{STORAGE_KEY}", JSON.stringify("machine_learning")); }} catch (e) {{}}
window.location.replace("../#/experiments?workflowType=machine_learning");
</script></body></html>
"""


def create_app():
    """MLflow's FastAPI app around its Flask app, with the model-training page added to the Flask app."""
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import create_fastapi_app

    if MODEL_TRAINING_PAGE not in {rule.rule for rule in flask_app.url_map.iter_rules()}:
        flask_app.add_url_rule(MODEL_TRAINING_PAGE, "tessera_model_training", lambda: _PAGE)
    return create_fastapi_app(flask_app)
