"""A flow run's own life: its process set-up, its one slot per run name, its bookkeeping and how it ends.

runtime.py           what every tessera process sets up first: offline, quiet, one-line errors
run_slot.py          one live flow run per run name, through a Prefect concurrency limit
run_record.py        the run's bookkeeping as tasks: commit, tags, name, recipe, MLflow link, champion bootstrap
flow_outcome.py      how a training flow run ends as a person should read it: Refused, Cancelled, form errors
last_word.py         a stopped flow run's explanation kept as its last state
stuck_runs.py        flow runs a deleted deployment or limit would leave stuck, ended or unstuck
"""
