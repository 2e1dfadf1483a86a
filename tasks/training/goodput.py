"""The goodput ledger: where a run's wall time went, from what the flow and the trainer already record.

Two sources, no new instrumentation:
- the flow's launch records (tasks/training/launch_records.py): each launch's start, end, how it ended, and a hang's
  silence before the watchdog killed it;
- each launch's time records (trainers/time_records.py): rank 0's seconds per heartbeat phase, written
  at every checkpoint and at the stage's end, so they count only work a checkpoint kept.

The wall a run is charged is its launches' time plus the gaps the system caused between them: the relaunch
delay and Prefect's retry backoff inside one flow run. It is not the calendar. Two things are left out, and the
ledger says how much of each: the time between two flow runs of the run (a person's pause before a rerun, a
schedule's week), and launches that found their stage already complete (a rerun with nothing to do). So a
no-op rerun leaves the figure as it was, and a run resumed a day later is not charged the day.

The buckets, which add up to that wall:
    productive  steps that a checkpoint kept (the data wait and step phases)
    startup     launching the processes, imports, the rendezvous, planning, the first step
    compile     torch.compile compiling the model's graphs (train.compile), on a launch's first steps
    load        loading the checkpoint a launch starts from, and downloading it
    save        checkpoint saves the step loop waited for, and the stage's last uploads
    eval        held-out batches scored at checkpoints
    lost        a launch's work after its last checkpoint, when it then failed: re-trained by the next
    hung        the silence before the watchdog killed a hung group
    restart     a restart in place (infra/launcher.py), from the crash or the kill to the restarted ranks' start
    pending     time a group waited in the cluster's queue before its pods ran (Kubernetes)
    idle        between launches (the relaunch delay, a Prefect retry) and a process's own exit
goodput = productive / wall.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from tasks.training import launch_records
from tasks.training.train_job import checkpoint_store
from trainers import time_records
from trainers.config import TrainJob

BUCKETS = ("productive", "startup", "compile", "load", "save", "eval", "lost", "hung", "restart", "pending", "idle")
WORDS = {
    "productive": "productive training (steps a checkpoint kept)",
    "startup": "startup (launch to the first step)",
    "compile": "compiling the model (torch.compile)",
    "load": "checkpoint load and download",
    "save": "checkpoint saves and final uploads",
    "eval": "held-out evaluation",
    "lost": "lost: steps re-trained after a failure",
    "hung": "hung (before the watchdog's kill)",
    "restart": "restarts in place (crash to the ranks' new start)",
    "pending": "pending in the cluster's queue",
    "idle": "between launches, and process exits",
}


LEFT_OUT = {
    "between_flow_runs": "between flow runs (a person's pause, a schedule's wait)",
    "no_op_launches": "launches that found their stage already complete",
}


@dataclass
class Goodput:
    wall_s: float = 0.0
    buckets: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    launches: int = 0
    tokens: int = 0
    left_out: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LEFT_OUT, 0.0))

    @property
    def ratio(self) -> float:
        return self.buckets["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def stage_ratio(self, stage: str) -> tuple[float, float]:
        """(goodput, wall seconds) of one stage's own launches and the gaps inside them."""
        buckets = self.stages.get(stage, {})
        wall = sum(buckets.values())
        return (buckets.get("productive", 0.0) / wall if wall > 0 else 0.0), wall

    def markdown(self, run_name: str) -> str:
        rows = [
            f"### Goodput of run {run_name}: {self.ratio:.1%}",
            "",
            f"{self.launches} launch(es), {self.tokens:,} tokens; the wall is the launches' time and the gaps the "
            "system caused between them (relaunches, retries), not the calendar.",
            "",
            "| where the time went | seconds | share |",
            "|---|---:|---:|",
        ]
        for name in BUCKETS:
            seconds = self.buckets[name]
            rows.append(f"| {WORDS[name]} | {seconds:,.1f} | {seconds / self.wall_s if self.wall_s else 0:.1%} |")
        rows.append(f"| **wall** | **{self.wall_s:,.1f}** | **100%** |")
        left = [f"{LEFT_OUT[k]}: {v:,.1f} s" for k, v in self.left_out.items() if v > 0]
        rows += ["", f"Left out of the wall: {'; '.join(left)}." if left else "Nothing was left out of the wall."]
        return "\n".join(rows)

    def metrics(self) -> dict[str, float]:
        out = {f"goodput/{name}_s": round(seconds, 3) for name, seconds in self.buckets.items()}
        out |= {f"goodput/left_out/{name}_s": round(seconds, 3) for name, seconds in self.left_out.items()}
        return out | {"goodput/ratio": round(self.ratio, 5), "goodput/wall_s": round(self.wall_s, 3)}


def _add(target: dict[str, float], source: dict[str, float]) -> None:
    for k, v in source.items():
        target[k] = target.get(k, 0.0) + v


def _attempts(launch: dict):
    """A launch as its attempts: split at each restart in place, each ending as that restart's cause (a crash, a
    hang); (attempt, whether it began with a restart)."""
    restarts = launch.get("restarts") or []
    bounds = [launch["started"], *[min(max(r["at"], launch["started"]), launch["ended"]) for r in restarts]]
    bounds.append(launch["ended"])
    for i in range(len(bounds) - 1):
        attempt = dict(launch, started=bounds[i], ended=bounds[i + 1])
        if i:
            attempt["pending_s"] = 0.0
        if i < len(restarts):
            attempt.update(kind="failed", stopped=False, hung=restarts[i].get("hung"))
        yield attempt, i > 0


def _launch_buckets(launch: dict, records: list[dict], restarted: bool = False) -> dict[str, float]:
    """One launch's (or restarted attempt's) wall time, bucket by bucket."""
    wall = max(0.0, launch["ended"] - launch["started"])
    out = dict.fromkeys(BUCKETS, 0.0)
    pending = float(launch.get("pending_s") or 0.0)
    out["pending"] = min(pending, wall)
    accounted_until = launch["started"] + out["pending"]
    if records:
        last = records[-1]
        p = last["phases"]
        out["productive"] = p.get("data", 0) + p.get("step", 0)
        out["restart" if restarted else "startup"] = max(0.0, last["process_start"] - accounted_until) + sum(
            p.get(k, 0) for k in ("startup", "plan", "first_step")
        )
        out["compile"] = p.get("compile", 0)
        out["load"] = p.get("download", 0) + p.get("load", 0)
        out["save"] = p.get("save", 0) + p.get("upload", 0)
        out["eval"] = p.get("eval", 0)
        out["idle"] = p.get("close", 0)
        accounted_until = min(launch["ended"], last["at"])
    remainder = max(0.0, launch["ended"] - accounted_until)
    if launch.get("kind") == "ok" or launch.get("stopped"):
        out["idle"] += remainder  # the process's exit; a cancel's stop
    else:
        hung = min(remainder, float((launch.get("hung") or {}).get("silent_s") or 0.0))
        out["hung"] = hung
        out["lost"] = remainder - hung
    return out


def compute(run_dir: str | Path, save_folder: str | Path, run_name: str) -> Goodput:
    """The run's goodput so far, from its launch records and its time records."""
    launches = sorted(launch_records.read(Path(run_dir)), key=lambda r: r["started"])
    records = time_records.read(save_folder, run_name)
    result = Goodput()
    if not launches:
        return result
    stages: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(BUCKETS, 0.0))
    previous: dict | None = None
    for launch in launches:
        if _no_op(launch):
            result.left_out["no_op_launches"] += max(0.0, launch["ended"] - launch["started"])
            continue
        part = dict.fromkeys(BUCKETS, 0.0)
        for attempt, restarted in _attempts(launch):
            mine = [r for r in records if attempt["started"] - 1 <= r["process_start"] <= attempt["ended"]]
            _add(part, _launch_buckets(attempt, sorted(mine, key=lambda r: r["at"]), restarted))
        result.wall_s += launch["ended"] - launch["started"]
        if previous is not None:
            gap = max(0.0, launch["started"] - previous["ended"])
            if _same_flow_run(previous, launch):  # the relaunch delay, a Prefect retry's backoff
                part["idle"] += gap
                result.wall_s += gap
            else:  # a person's pause, a schedule's week: not the run's time
                result.left_out["between_flow_runs"] += gap
        previous = launch if previous is None or launch["ended"] >= previous["ended"] else previous
        _add(result.buckets, part)
        _add(stages[launch["stage"]], part)
        result.tokens = max(result.tokens, int(launch.get("tokens_after") or 0))
        result.launches += 1
    result.stages = dict(stages)
    return result


def _no_op(launch: dict) -> bool:
    """A launch that ended well having trained nothing: it found its stage already complete."""
    return launch.get("kind") == "ok" and (launch.get("tokens_after") or 0) == (launch.get("tokens_before") or 0)


def _same_flow_run(a: dict, b: dict) -> bool:
    """Whether two launches belong to one flow run (launches recorded before the flow run was, never)."""
    return a.get("flow_run") is not None and a.get("flow_run") == b.get("flow_run")


def chart(goodput: Goodput, path: Path) -> Path:
    """A stacked bar per stage (and the whole run): where the time went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*goodput.stages, "run"]
    columns = [*goodput.stages.values(), goodput.buckets]
    fig, ax = plt.subplots(figsize=(2 + 1.3 * len(names), 4.5))
    bottoms = [0.0] * len(names)
    for bucket in BUCKETS:
        heights = [c.get(bucket, 0.0) / 60 for c in columns]
        ax.bar(names, heights, bottom=bottoms, label=WORDS[bucket])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("minutes")
    ax.set_title(f"goodput {goodput.ratio:.1%}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def for_job(run_dir: str | Path, job) -> Goodput:
    """The goodput of `job`'s run, its time records read through the run's checkpoint store: with the ranks in pods,
    this machine's copy lacks them and the s3 save folder has them."""
    import tempfile

    name = time_records.path(job.save_folder, job.run_name).name
    with tempfile.TemporaryDirectory(prefix="tessera-goodput-") as tmp:
        try:
            (Path(tmp) / name).write_text(checkpoint_store(job).read_text(name))
        except FileNotFoundError:  # none written yet: every launch's time is unaccounted
            pass
        except Exception as exc:  # noqa: BLE001 - an unreachable mirror costs the report its detail, never the run
            logging.getLogger("tessera.goodput").warning(
                "goodput of %s: cannot read its time records (%s); each launch's time is left unaccounted",
                job.run_name,
                " ".join(str(exc).split())[:300],
            )
        return compute(run_dir, tmp, job.run_name)


def report(run_dir: str | Path, job) -> Goodput:
    """The run's goodput so far (`job`: its trainers.config.TrainJob), said where people look: a Prefect artifact on
    the flow run, and in MLflow the goodput/* metrics at the tokens reached, the table and the stacked chart
    (artifacts goodput/*). With the ranks in pods, their time records come from the s3 save folder."""
    import json
    import tempfile

    from mlflow.tracking import MlflowClient
    from prefect.artifacts import create_markdown_artifact

    from tasks.artifacts import artifact_key
    from tasks.mlflow_run import retrying

    goodput = for_job(run_dir, job)
    if not goodput.launches:
        return goodput
    text = goodput.markdown(job.run_name)
    key = artifact_key(job.run_name, "goodput")
    create_markdown_artifact(markdown=text, key=key, description=f"Goodput of run {job.run_name}")
    if job.mlflow is None:
        return goodput
    client, run_id = MlflowClient(tracking_uri=job.mlflow.tracking_uri), job.mlflow.run_id
    for name, value in goodput.metrics().items():
        retrying(f"logging {name}", lambda n=name, v=value: client.log_metric(run_id, n, v, step=goodput.tokens))
    with tempfile.TemporaryDirectory(prefix="tessera-goodput-") as tmp:
        folder = Path(tmp)
        (folder / "goodput.md").write_text(text + "\n")
        (folder / "goodput.json").write_text(
            json.dumps(
                {
                    "wall_s": goodput.wall_s,
                    "ratio": goodput.ratio,
                    "buckets": goodput.buckets,
                    "stages": goodput.stages,
                },
                indent=2,
            )
        )
        chart(goodput, folder / "goodput.png")
        for file in ("goodput.md", "goodput.json", "goodput.png"):
            retrying(f"logging goodput/{file}", lambda f=file: client.log_artifact(run_id, str(folder / f), "goodput"))
    return goodput


@task(cache_policy=NO_CACHE, task_run_name="goodput-{stage_name}")
def report_goodput(job: TrainJob, run_dir: str, stage_name: str) -> float | None:
    """At a stage's end: where the run's wall time went so far (`report`), as a Prefect artifact and in
    MLflow. A report: it never fails the run."""
    try:
        goodput = report(run_dir, job)
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning("stage %s: the goodput report failed: %s", stage_name, exc)
        return None
    if goodput.launches and stage_name in goodput.stages:
        ratio, wall = goodput.stage_ratio(stage_name)
        own = goodput.stages[stage_name]
        get_run_logger().info(
            "stage %s: goodput %.1f%% of its %.0f s (productive %.0f s, lost %.0f s, hung %.0f s); the run so far "
            "%.1f%% of %.0f s",
            stage_name,
            100 * ratio,
            wall,
            own["productive"],
            own["lost"],
            own["hung"],
            100 * goodput.ratio,
            goodput.wall_s,
        )
    return goodput.ratio
