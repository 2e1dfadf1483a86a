"""Prefect tasks, one unit of work each, and what they share; flows/ sequences them.

A run and its stages
recipe.py            the recipe: the YAML a user edits, validated into one Recipe of each package's sections
recipe_form.py       the recipe as a Prefect form shows it: plain optional inputs, the overrides a run may make
runtime.py           what every tessera process sets up first: offline, quiet, one-line errors
flow_outcome.py      how a training flow run ends as a person should read it: Refused, Cancelled, form errors
run_slot.py          one live flow run per run name, through a Prefect concurrency limit
run_record.py        the run's bookkeeping as tasks: commit, tags, name, recipe, MLflow link, champion bootstrap
last_word.py         a stopped flow run's explanation kept as its last state
stuck_runs.py        flow runs a deleted deployment or limit would leave stuck, ended or unstuck
prepare.py           the prepare stage's tasks: the tokenizer, the plan, one source each
train.py             one curriculum stage as a job on the compute backend, relaunched through preemptions
train_job.py         the job file a stage's trainer reads, resolved from the recipe and the prepared data
train_progress.py    a job's progress lines relayed to Prefect's log, a progress artifact and a bar
launch_records.py    the launches of a run, one JSON line each (the no-progress stop and goodput read them)
goodput.py           the goodput ledger: where a run's wall time went, and the task that reports it
retry.py             retry conditions: what may be transient, never what fails the same way again
disk.py              a full disk said in one line, naming the folder and its free space
artifacts.py         Prefect artifact keys, scoped to the run

Checkpoints, the gauntlet and the registry
gauntlet_queue.py    every new checkpoint pinned, evaluated, then registered, while training goes on; its backlog
evaluate.py          one checkpoint scored, logged to the training run, a markdown artifact left
score.py             a model scored outside training: `tessera eval`, `compare`, promotion
register.py          an evaluated checkpoint registered as an MLflow Model version, its aliases moved
aliases.py           the registry's aliases: tessera's moves, their record, the moves made elsewhere
version_record.py    what the registry knows of a version beyond its tags: a record and its decision history
mlflow_run.py        the run's MLflow run, found or created once per run name; the client with its retries
tracking_config.py   the recipe's `tracking` section

Continued pretraining and promotion
continuation.py      what a continued run trains: base version, tokenizer, budget, its recipe
consumed_files.py    which input files continued pretraining has trained on, kept in MLflow
promote.py           champion against challenger on fresh scores, moved by the rule
promote_rule.py      the rule: is the challenger's gain real, by the recipe's `promote` section
promote_lock.py      one move of a model's champion at a time, whoever makes it
promote_config.py    the recipe's `promote` section

data/                the prepare stage's data handling, free of Prefect
"""
