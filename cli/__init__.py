"""The front door: the `tessera` command, `tessera up` (the local stack) and deploy. Nothing here is a flow.

entry.py         the `tessera` script: supervision first, then the command
stopping.py      how a command ends when told to stop, at any moment: one line, 128+N, nothing left running
guardian.py      the guard that ends whatever a command started once the command is gone, SIGKILL included
main.py          the `tessera` command: its parser, `run`, `prepare`, `status`, and one-line errors with exit codes
models.py        `tessera eval`, `compare`, `promote` and `continue`: the commands about models rather than runs
k8s.py           `tessera k8s render` and `status`: the Kubernetes backend's objects, without running a flow
deploy.py        `tessera deploy`: prefect.yaml's deployments published, their forms bounded by a recipe
forms.py         the published forms' schemas: a recipe's bounds, and every bound where Prefect's UI checks it
up.py            `tessera up`: Prefect server, a process worker and MLflow on this machine, until Ctrl-C
up_plan.py       what `tessera up` will start and where: ports, URLs, each service's command and environment
up_stack.py      the processes `tessera up` starts and stops, and everything they start in turn
service_logs.py  errors `tessera up`'s services log, said on its terminal too
mlflow_app.py    the MLflow server `tessera up` runs: MLflow's app plus the page that opens it in model training
"""
