"""Entrypoint of a training pod: `python -m trainers.train --job JOB.json --stage K`.

Trains stage K (0-based) up to the cumulative token count of stages 0..K, resuming from the
job's save folder. Run it under tessera's launcher (torch's elastic agent) for several ranks:
`python -m infra.launcher --nproc-per-node N -m trainers.train --job JOB.json --stage K`.
Exit codes: trainers/exit_codes.py.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys

from trainers import heartbeat
from trainers.disk import fault_line, full_disk_line, no_space, permanent_fault
from trainers.exit_codes import (
    ExitCode,
    FatalError,
    InfrastructureError,
    classify,
    code_on_signal,
    decide_exit,
)
from trainers.jobfile import load_job
from trainers.supervisor import supervisor_gone, watch_supervisor


def stop_on_signals() -> None:
    """SIGTERM and SIGINT leave at once with a code a supervisor can read.

    Composer's engine module installs handlers that exit 128+N, which reads as a crash. The
    signals come from a preemption, from the launcher stopping the survivors after a peer died,
    or from a cancel: none is the trainer's failure, and a relaunch resumes from the last checkpoint.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(code_on_signal()))


FREE_SPACE_FIX = (
    "free some space (or give train.save_folder a larger disk), then rerun: it resumes from the last complete "
    "checkpoint"
)


def fatal(exc: FatalError) -> ExitCode:
    """Leave fatal with one line; damaged prepared data is also named on stdout for the flow, which withdraws that
    output's done-marker (trainers/data_check.py)."""
    decide_exit(ExitCode.FATAL)
    try:
        if getattr(exc, "record", None) is not None:
            from trainers.data_check import announce

            announce(exc)
        print(f"tessera.train: fatal: {exc}", file=sys.stderr, flush=True)
    except OSError:  # the log is on a disk that is full: the exit code still says fatal
        pass
    return ExitCode.FATAL


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainers.train", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="TrainJob JSON written by the flow")
    parser.add_argument("--stage", required=True, type=int, help="0-based curriculum stage to train")
    return parser.parse_args(argv)


def _refresh_import_time_ranks() -> None:
    """Values libraries computed from RANK or LOCAL_RANK when they were imported. A rank forked from a launch's
    warm process (infra/warm.py, WARM_MODULES) got its modules imported there, before any rank existed: Composer
    would name every rank's checkpoint shard `__0_0.distcp` (rank 1 of a node whose disk holds only its own shard
    then fails its save, seen in test_two_nodes_without_a_shared_folder_resume_through_s3) and torchmetrics would
    print as local rank 0. Set again from this rank's environment; in a fresh interpreter they are already right."""
    shard = f"__{int(os.environ.get('RANK', '0'))}_0.distcp"
    for name in ("composer.utils.checkpoint", "composer.checkpoint.save"):  # the second copies the first's value
        if name in sys.modules:
            sys.modules[name]._TORCH_DISTRIBUTED_CHECKPOINTS_FILENAME = shard
    if "torchmetrics.utilities.prints" in sys.modules:
        sys.modules["torchmetrics.utilities.prints"].rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", "0"))


def _import_trainer() -> tuple:
    """Composer and the rest of the trainer, imported with CPython's cyclic collector off, then frozen: the imports
    allocate a few hundred thousand long-lived objects, and a collector walking that growing heap costs a third
    more CPU (infra/warm_open.py, which does the same for ranks forked warm: there this finds them imported)."""
    gc.disable()
    try:
        from trainers.build import build_trainer
        from trainers.metrics_journal import deliver, remote_copy
        from trainers.rollback import record_anomaly
    finally:
        gc.freeze()  # never walked by the training loop's collections, nor copied into its dataloader workers
        gc.enable()
    return build_trainer, deliver, remote_copy, record_anomaly


def main(argv: list[str] | None = None) -> int:
    watch_supervisor()  # first: a rank still importing torch must not outlive its flow either
    _refresh_import_time_ranks()
    heartbeat.start()  # and the watchdog beside the ranks sees this one from its first second
    stop_on_signals()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    trainer = job = None
    try:
        job = load_job(args.job)
        if not job.train.trust_checkpoints:
            from trainers.format.safe_load import force_weights_only

            force_weights_only()  # Composer's own resume included: no checkpoint runs code in the trainer
        # Heavy imports after validating, so `--help` and a bad job file answer at once.
        build_trainer, deliver, remote_copy, record_anomaly = _import_trainer()

        stop_on_signals()  # again: importing Composer replaced our handlers with its own
        trainer = build_trainer(job, args.stage)
        if trainer is None:  # the stage finished in an earlier launch; what it could not send to MLflow goes now
            if job.mlflow is not None and os.environ.get("RANK", "0") == "0":
                # with an s3 save folder the copy there is emptied too, or the flow would send the rows again
                deliver(job.mlflow, job.save_folder, job.run_name, copy=remote_copy(job))
            return ExitCode.OK
        try:
            trainer.fit()
        except Exception as exc:  # every failure maps to an exit code below
            code = record_anomaly(job, exc)  # NaN / spike: schedule a rollback, or give up
            if code is not None:
                decide_exit(code)
                return code
            raise
        return ExitCode.OK
    except FatalError as exc:
        return fatal(exc)
    except InfrastructureError as exc:  # the node, not the job: relaunched on the preemption budget
        decide_exit(ExitCode.INTERRUPTED)
        print(f"tessera.train: {exc}", file=sys.stderr, flush=True)
        return ExitCode.INTERRUPTED
    except Exception as exc:
        from trainers.data_check import first_damage

        if first_damage() is not None:  # Streaming's download thread found it; the loop saw only a failure
            return fatal(first_damage())
        full = no_space(exc)
        if full is not None:  # a checkpoint, the metrics journal, a log: a relaunch would fill the same disk
            where = job.save_folder if job is not None else "."
            return fatal(FatalError(full_disk_line(full, where, FREE_SPACE_FIX)))
        fault = permanent_fault(exc)
        if fault is not None:  # a name too long, a read-only folder: named, and not retried
            return fatal(FatalError(fault_line(fault)))
        code = classify(exc)
        if code == ExitCode.RETRYABLE and supervisor_gone():
            code = ExitCode.INTERRUPTED
            print(f"tessera.train: stopping: the supervisor is gone ({type(exc).__name__}: {exc})", file=sys.stderr)
        else:
            logging.getLogger("tessera.train").exception("training failed (%s)", code.name.lower())
        decide_exit(code)
        return code
    finally:
        if trainer is not None:
            try:
                trainer.close()
            except Exception:  # with a peer gone, close's collectives fail too; keep the exit code
                logging.getLogger("tessera.train").warning("trainer.close() failed", exc_info=True)


if __name__ == "__main__":
    code = main()
    if code != ExitCode.OK:
        # After a lost peer, interpreter teardown can block on dead collectives until the launcher
        # SIGTERMs us, and the exit code would read as a signal: leave with the decided code now.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # a full disk under the log: the code still says what happened
                pass
        os._exit(code)
    sys.exit(code)
