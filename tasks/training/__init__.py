"""Training a run: each curriculum stage as a job on the compute backend, and what its launches leave.

train.py             one curriculum stage as a job on the compute backend, relaunched through preemptions
stage_ends.py        how a launch ends: the budget its exit code draws on, the one-line errors a stage fails with
train_job.py         the job file a stage's trainer reads, and the checkpoint store the flow reads its run through
train_progress.py    a job's progress lines relayed to Prefect's log, a progress artifact and a bar
launch_records.py    the launches of a run, one JSON line each (the no-progress stop and goodput read them)
goodput.py           where a run's wall time went, and the task that reports it
gauntlet_queue.py    every new checkpoint pinned, evaluated, then registered, while training goes on; its backlog
"""
