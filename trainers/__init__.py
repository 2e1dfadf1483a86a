"""What runs inside a training pod: `python -m trainers.train --job JOB.json --stage K`.

train.py           thin entrypoint: parse, build, fit, close; exit codes from exit_codes.py
jobfile.py         read + validate the TrainJob (config/job.py) without heavy imports
config/            the typed sections the recipe owns here (model, train) and the resolved TrainJob
build.py           assemble the Composer Trainer for one stage
start.py           where a launch starts: its process group, the plan every rank shares, each node's data check
model.py           the Llama-style decoder, size presets, vocabulary padding, FLOPs per token
compile.py         train.compile: each block's forward compiled, the keyed kernel cache, the compile phase
lm_loss.py         the training loss without the logits: a chunked, fused linear cross-entropy
data.py            one StreamingDataset epoch per stage over the stage's mixture
data_check.py      every shard's bytes against the hash its index records, before a launch trains on them
sharding.py        how several ranks share the model: Composer's FSDP2, per decoder block
rendezvous.py      the launch's process group and store (bound where the launcher said), and the start plan's answers
preflight.py       before a launch spends compute: room to save, and ranks that compute and talk like their peers
schedule.py        the global LR curve (a pure function of tokens) and the callback that applies it
layout.py          the save folder's file names, and the one place that removes a checkpoint
plan.py            start plan (resume / enter stage / fresh) after repairing what a kill left
trained_stages.py  the specs of stages already trained on (appending allowed, editing refused)
saver.py           which steps are saved, and how a save is published (manifest, then symlink)
remote.py          rank 0's side of the s3 mirror: background uploads, keep-last-K, reconcile, download
rollback.py        NaN / spike rollback records and the data skip on relaunch
callbacks.py       MLflow metrics, progress lines, the loss guard, test probes
metrics_outbox.py  metrics to MLflow off the step's path: queue, write-ahead journal, shipper thread
metrics_journal.py  the journal's format (rows, acks, marker, its s3 copy) and the reader that delivers leftovers
heartbeat.py       this rank's phase and last progress, for the watchdog beside the ranks
rank_timing.py     where each rank's steps go (data wait, compute, collectives), and which rank is slow
time_records.py    where a launch's time went, as rank 0 saw it: a JSON line per checkpoint (goodput reads it)
disk.py            a full disk found in an error's chain, said in one line naming the folder
progress.py        the `tessera.start` / `tessera.progress` line formats and parsers (no torch: the flow imports it)
folder_lock.py     one trainer per run name: rank 0's flock on <save_folder>/<run>.lock
supervisor.py      every rank stops when the process that launched the job is gone
optimizer_seed.py  Adam state from another run's checkpoint, where names and shapes match
rng.py             the RNG state put back on a resume inside a stage
shm.py             Streaming's shared memory left by a killed launch, removed where nothing maps it
faults.py          every test hook (TESSERA_FAULT, TESSERA_SAMPLE_LOG)
exit_codes.py      the codes and the exceptions behind them
contract.py        environment variables and exit codes shared with the launchers (infra imports only this)
format/            the checkpoint format: manifests and checks, export to HF and MLflow (evaluation and
                   tasks read checkpoints through it; it imports nothing else of tessera)

Nothing here imports Prefect: the package must run in a bare training image.
"""
