"""What runs inside a training pod: `python -m trainers.train --job JOB.json --stage K`.

train.py     thin entrypoint: parse, build, fit, close; exit codes from exit_codes.py
jobfile.py   read + validate the TrainJob (config.py) without heavy imports
build.py     assemble the Composer Trainer for one stage
model.py     the Llama-style decoder, size presets, FLOPs per token
data.py      one StreamingDataset epoch per stage over the stage's mixture
schedule.py  the global LR curve (a pure function of tokens) and the callback that applies it
layout.py    the save folder's file names, and the one place that removes a checkpoint
plan.py      start plan (resume / enter stage / fresh) after repairing what a kill left
ledger.py    the specs of stages already trained on (appending allowed, editing refused)
saver.py     which steps are saved, and how a save is published (manifest, then symlink)
rollback.py  NaN / spike rollback records and the data skip on relaunch
callbacks.py MLflow metrics, progress lines, the loss guard, test probes
metrics_outbox.py  metrics to MLflow off the step's path: queue, write-ahead journal, shipper thread
progress.py  the `tessera.progress {json}` line format and its parser (no torch: the flow imports it)
lease.py     one trainer per run name: rank 0's flock on <save_folder>/<run>.lock
supervisor.py  every rank stops when the process that launched the job is gone (TESSERA_SUPERVISOR_PID)
export.py    Composer checkpoint -> HF model directory
checkpoints.py the manifest contract with watchers

Nothing here imports Prefect: the package must run in a bare training image.
"""
