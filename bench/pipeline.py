"""Orchestration overhead of a run triggered through a deployment, as the Prefect UI triggers it.

Setup (not timed): `tessera up` on free ports under a temporary work dir (Prefect server, a process
worker, MLflow, the deployments), and the recipe's data prepared once with `tessera prepare`, as it
is for every run after a source's first.
Timed: the tiny recipe scaled up (192 steps of 8 x 128 tokens in two stages, a gauntlet every 64
steps) is triggered through the REST API (`POST /deployments/{id}/create_flow_run`) and runs to
COMPLETED on the worker. The wall time, trigger to the flow run's end, is split with the task and
subflow runs' own start and end times:
  prepare   the prepare-sources subflows (cached here: finding the outputs done);
  train     the train-<stage> task runs (trainer start-up and its steps);
  eval      evaluate-tok-* task runs, where they do not overlap training (evaluations run alongside it);
  register  register-tok-* task runs, where they overlap neither;
  rest      everything else: the worker picking the run up, the flow process starting, the MLflow
            run, the job file, alias moves, artifacts.
trigger_to_first_step_s is the trigger to the wall-clock time of the first train/loss point in MLflow.

Prints one JSON line last: {"bench": "pipeline", "orchestration_share": rest / wall, ...}.
Goals: orchestration_share <= 0.05, trigger_to_first_step_s <= 30 on this machine (2 CPU cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import argparse
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def recipe_in(tmp: Path, scale: int) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["work_dir"] = str(tmp / "work")
    raw["data"]["root"] = str(tmp / "work" / "data")
    raw["tracking"]["tracking_uri"] = f"sqlite:///{tmp / 'mlflow.db'}"
    raw["tracking"]["artifact_location"] = str(tmp / "mlartifacts")
    for stage in raw["train"]["stages"]:
        stage["tokens"] *= scale
    raw["eval"]["every"] *= scale
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def ts(text: str | None) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else 0.0


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def minus(intervals: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `intervals` outside `cut` (both unions)."""
    out = []
    for start, end in intervals:
        pieces = [(start, end)]
        for c0, c1 in cut:
            pieces = [p for s, e in pieces for p in ((s, min(e, c0)), (max(s, c1), e)) if p[1] > p[0]]
        out += pieces
    return out


def wait_ready(api: str, mlflow: str, up: subprocess.Popen, output: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if up.poll() is not None:
            raise SystemExit(f"tessera up exited:\n{output.read_text()}")
        try:
            workers = httpx.post(
                f"{api}/work_pools/tessera-local/workers/filter",
                timeout=5,
                json={"workers": {"status": {"any_": ["ONLINE"]}}, "limit": 5},
            ).json()
            deployed = httpx.get(f"{api}/deployments/name/pretrain_pipeline/pretrain", timeout=5).status_code == 200
            if workers and deployed and httpx.get(f"{mlflow}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"tessera up not ready after {timeout:.0f} s:\n{output.read_text()}")
        time.sleep(1)


def runs_of(api: str, flow_run_id: str) -> tuple[list[dict], list[dict]]:
    """(subflow runs, task runs) of a flow run and its subflows."""
    subflows = httpx.post(
        f"{api}/flow_runs/filter",
        timeout=30,
        json={"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}, "limit": 200},
    ).json()
    ids = [flow_run_id] + [f["id"] for f in subflows]
    tasks = httpx.post(
        f"{api}/task_runs/filter", timeout=30, json={"flow_runs": {"id": {"any_": ids}}, "limit": 200}
    ).json()
    return subflows, tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4, help="multiplies the tiny recipe's stage tokens and eval.every")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tessera-bench-pipeline-") as tmp_name:
        tmp = Path(tmp_name)
        recipe = recipe_in(tmp, args.scale)
        env = {**os.environ, "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"}
        prepared = subprocess.run(
            [sys.executable, "-m", "cli.main", "prepare", str(recipe)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        if prepared.returncode != 0:
            raise SystemExit(f"tessera prepare failed:\n{prepared.stderr[-3000:]}")
        prefect_port, mlflow_port = free_port(), free_port()
        api, mlflow = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
        output = tmp / "up.out"
        with open(output, "wb") as out:
            up = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cli.main",
                    "up",
                    str(recipe),
                    "--work-dir",
                    str(tmp / "work"),
                    "--prefect-port",
                    str(prefect_port),
                    "--mlflow-port",
                    str(mlflow_port),
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            wait_ready(api, mlflow, up, output)
            deployment = httpx.get(f"{api}/deployments/name/pretrain_pipeline/pretrain", timeout=10).json()
            trigger = time.time()
            run = httpx.post(
                f"{api}/deployments/{deployment['id']}/create_flow_run",
                timeout=30,
                json={"parameters": {"params": {"recipe": str(recipe), "run_name": "bench"}}},
            ).json()
            while (state := httpx.get(f"{api}/flow_runs/{run['id']}", timeout=30).json())["state"]["type"] not in (
                "COMPLETED",
                "FAILED",
                "CRASHED",
                "CANCELLED",
            ):
                time.sleep(1)
            if state["state"]["type"] != "COMPLETED":
                raise SystemExit(f"the run ended {state['state']['type']}: {state['state']['message']}")
            end = ts(state["end_time"])
            subflows, tasks = runs_of(api, run["id"])
            from mlflow.tracking import MlflowClient

            client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
            experiment = client.get_experiment_by_name("tessera-tiny")
            mlrun = client.search_runs([experiment.experiment_id], "tags.`tessera.run_name` = 'bench'")[0]
            losses = client.get_metric_history(mlrun.info.run_id, "train/loss")
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(120)

    def spans(pick) -> list[tuple[float, float]]:
        return union([(ts(r["start_time"]), ts(r["end_time"])) for r in pick])

    prepare = spans(subflows)  # the pipeline's only subflows are its prepare-sources runs
    train = spans([t for t in tasks if t["name"].startswith("train-")])
    evaluate = minus(spans([t for t in tasks if t["name"].startswith("evaluate-")]), train)
    register = minus(spans([t for t in tasks if t["name"].startswith("register-")]), union(train + evaluate))
    wall = end - trigger
    busy = length(union(prepare + train + evaluate + register))
    first_step = min(m.timestamp for m in losses) / 1000 - trigger
    rest = wall - busy
    tokens = max(m.step for m in losses)
    print(
        f"wall {wall:.1f} s: prepare {length(prepare):.1f}, train {length(train):.1f}, eval (outside training) "
        f"{length(evaluate):.1f}, register (outside both) {length(register):.1f}, rest {rest:.1f}"
    )
    print(
        f"trigger -> first training step: {first_step:.1f} s; {len(losses)} steps, {tokens:,} tokens; "
        f"{len(subflows)} prepare subflow(s), {len(tasks)} task runs"
    )
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "orchestration_share": round(rest / wall, 4),
                "trigger_to_first_step_s": round(first_step, 1),
                "wall_s": round(wall, 1),
                "prepare_s": round(length(prepare), 1),
                "train_s": round(length(train), 1),
                "eval_s": round(length(evaluate), 1),
                "register_s": round(length(register), 1),
                "rest_s": round(rest, 1),
                "steps": len(losses),
                "tokens": tokens,
                "data": "prepared beforehand",
                "goal": {"orchestration_share": 0.05, "trigger_to_first_step_s": 30},
                "device": "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()
