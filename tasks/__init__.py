"""Prefect tasks, one unit of work each, and what they share; flows/ sequences them.

data/                the prepare stage's data handling, free of Prefect
training/            each curriculum stage as a job, relaunched through preemptions; progress, launches, goodput;
                     the queue that scores and registers each checkpoint while a stage trains
gauntlet/            checkpoints scored on the gauntlet, while a run trains and outside one
registry/            model versions, aliases, their records, and the champion's promotion
runs/                a flow run's own life: set-up, one slot per run name, bookkeeping, how it ends

recipe.py            the recipe: the YAML a user edits, validated into one Recipe of each package's sections
recipe_form.py       the recipe as a Prefect form shows it: plain optional inputs, the overrides a run may make
prepare.py           the prepare stage's tasks: the tokenizer, the plan, one source each
continuation.py      what a continued run trains: base version, tokenizer, budget, its recipe
consumed_files.py    which input files continued pretraining has trained on, kept in MLflow
mlflow_run.py        the run's MLflow run, found or created once per run name; the client with its retries
tracking_config.py   the recipe's `tracking` section
retry.py             retry conditions: what may be transient, never what fails the same way again
disk.py              a full disk said in one line, naming the folder and its free space
slots.py             one-slot Prefect concurrency limits: the run-name slot's and the promotion lock's
artifacts.py         Prefect artifact keys, scoped to the run
"""
