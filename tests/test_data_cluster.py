"""The prepare stage on Kubernetes, data side: the rendered pod command run as local processes against a real (moto)
S3 server gives the local prepare's output byte for byte, and the flow drives the prepare Job through the launcher
against tests/k8s/fake_apiserver.py, with the test playing the Job controller by running each index's pod command
as a local process. No real cluster runs here (docs/KUBERNETES.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from cli.main import main
from tasks.data import cluster, partitions, pipeline, remote_root, tokenizer
from tasks.data.errors import DataError
from tests.conftest import ROOT
from tests.k8s.variants import CPU_ONE_NODE, compute
from tests.test_data_helpers import SHAKESPEARE, make_config
from tests.test_data_partitions import shards_and_indexes
from tests.test_k8s_launcher import Cluster, settle
from tests.test_k8s_launcher import api as api  # the fake API server fixture, shared

SIZES = dict(chunk_bytes=64 << 10, partition_bytes=200 << 10)  # tinyshakespeare: 5 partitions
BUCKET = "data"


def _upload(moto_s3, text: str, name: str = "plays.txt") -> str:
    moto_s3.put_object(Bucket=BUCKET, Key=f"corpora/{name}", Body=text.encode())
    return f"s3://{BUCKET}/corpora/{name}"


def _data(tmp_path, path: str, **kw):
    src = {"name": "plays", "paths": [path], "separator": "\n\n", "val_fraction": 0.1, **kw}
    data = make_config(tmp_path / "unused", [src], seq_len=128, **SIZES)
    return data.model_copy(update={"root": f"s3://{BUCKET}/prepared", "local_cache": str(tmp_path / "cache")})


def _published_tokenizer(data):
    tok = tokenizer.resolve(data.tokenizer, data.local_root, data.sources, data.chunk_bytes)
    uri = f"{data.root}/{os.path.basename(tok.hf_dir)}"
    remote_root.publish(tok.hf_dir, uri)
    return tok.model_copy(update={"uri": uri})


def _bucket_files(moto_s3, root: str, tmp_path) -> dict[str, bytes]:
    """The output's shards and indexes in the bucket, by path within the output."""
    prefix = root.removeprefix(f"s3://{BUCKET}/") + "/"
    found = {}
    for page in moto_s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            rel = o["Key"][len(prefix) :]
            if rel.startswith(("train/", "val/")):
                found[rel] = moto_s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
    return found


def _local_reference(tmp_path) -> dict[str, bytes]:
    data = make_config(
        tmp_path / "local",
        [{"name": "plays", "paths": [str(SHAKESPEARE)], "separator": "\n\n", "val_fraction": 0.1}],
        seq_len=128,
        **SIZES,
    )
    tok = tokenizer.resolve(data.tokenizer, data.root, data.sources, data.chunk_bytes)
    return shards_and_indexes(pipeline.prepare_source(data.sources[0], data, tok).root)


def _run_pod(argv: list[str], env: dict, index: int, tmp_path) -> subprocess.CompletedProcess:
    """One pod of the Job as a local process: its command and environment, this machine's python and scratch."""
    scratch = tmp_path / "pod-scratch"
    scratch.mkdir(exist_ok=True)
    full = {**os.environ, **env, "JOB_COMPLETION_INDEX": str(index), "TMPDIR": str(scratch)}
    full["TESSERA_PREPARE_WORKERS"] = "1"  # two CI cores; the pod's own count is its cpu request
    full.pop("AWS_ENDPOINT_URL", None)  # the recipe's endpoint is a cluster's; moto's is S3_ENDPOINT_URL here
    return subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)


def _k8s_recipe(tmp_path, data) -> str:
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw["work_dir"] = str(tmp_path / "work")
    raw["data"] = yaml.safe_load(data.model_dump_json())
    raw["train"]["save_folder"] = "s3://tessera-ckpt/runs"
    for stage in raw["train"]["stages"]:
        stage["mixture"] = {"plays": 1.0}
    raw["tracking"]["tracking_uri"] = "http://mlflow.tessera.svc:5000"
    raw["compute"] = CPU_ONE_NODE
    path = tmp_path / "k8s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.slow  # five pod processes, each importing the prepare stage
def test_the_rendered_pod_command_run_for_each_index_gives_the_local_prepares_output(tmp_path, moto_s3, capsys):
    moto_s3.create_bucket(Bucket=BUCKET)
    data = _data(tmp_path, _upload(moto_s3, SHAKESPEARE.read_text()))
    tok = _published_tokenizer(data)
    plans = [pipeline.plan(src, data, tok) for src in data.sources]
    started = time.time()
    _, todo = cluster.plan_outputs(plans, data, tok)  # what the flow does before it submits the Job
    index_uri = cluster.write_index(data, todo)

    # `tessera k8s render --prepare` plans the same Job from the data: the same index file, one index a partition
    assert main(["k8s", "render", _k8s_recipe(tmp_path, data), "--prepare"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# tessera: from ") and "5 partitions left to prepare, planned from the data" in out
    (job,) = [d for d in yaml.safe_load_all(out) if d]
    assert (job["kind"], job["spec"]["completionMode"], job["spec"]["completions"]) == ("Job", "Indexed", 5)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == cluster.pod_command(index_uri)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}

    for index in range(5):
        done = _run_pod(container["command"], env, index, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"partition {partitions.folder(index)} prepared by " in done.stdout
    again = _run_pod(container["command"], env, 2, tmp_path)  # a retried index finds its partition done
    assert again.returncode == 0 and "already prepared, nothing to do" in again.stdout
    merged = cluster.merge_outputs(todo, data, started)["plays"]
    assert remote_root.is_done(merged.root) and not merged.cached
    assert _bucket_files(moto_s3, merged.root, tmp_path) == _local_reference(tmp_path)
    prov = remote_root.read_provenance(merged.root)
    assert [p["index"] for p in prov["partitions"]] == list(range(5))
    assert all(p["writer"] and p["tokens"] > 0 for p in prov["partitions"])
    assert sum(p["tokens"] for p in prov["partitions"]) == (
        prov["counts"]["train"]["tokens_written"] + prov["counts"]["val"]["tokens_written"]
    )


def _play_job_controller(c, name: str, tmp_path, seen: list | None = None) -> None:
    """The Job controller and kubelet: each index's pod runs the Job's command as a local process, its output the
    pod's log; the Job then ends as the controller ends it (Complete, or Failed by the exit-78 rule)."""
    job = c.wait_for("Job", name)
    spec = job["spec"]
    if seen is not None:
        seen.append(spec)
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    done = []
    for index in range(spec["completions"]):
        (pod,) = c.start_pods(job, indexes=[index])
        run = _run_pod(container["command"], env, index, tmp_path)
        c.log(pod, run.stdout + run.stderr)
        c.terminate(pod, run.returncode)
        if run.returncode != 0:
            c.set_condition(
                "Job",
                name,
                "Failed",
                "PodFailurePolicy",
                f"Container preparer for pod default/{pod} failed with exit code {run.returncode} matching FailJob "
                "rule at index 1",
                failedIndexes=str(index),
            )
            return
        done.append(index)
        c.set_status("Job", name, completedIndexes=f"0-{index}" if index else "0", succeeded=len(done))
    settle()
    c.set_condition(
        "Job", name, "Complete", "CompletionsReached", "Reached expected number of succeeded pods", succeeded=len(done)
    )


def _job_name(c) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        jobs = [name for kind, name in c.creates if kind == "Job"]
        if jobs:
            return jobs[-1]
        time.sleep(0.2)
    raise AssertionError("no Job was created")


@pytest.mark.slow  # a Prefect flow, five pod processes, then one more
def test_the_flow_prepares_on_the_cluster_and_a_rerun_submits_only_the_partitions_left(
    tmp_path, moto_s3, api, prefect_harness
):
    from flows.prepare import prepare_sources

    moto_s3.create_bucket(Bucket=BUCKET)
    data = _data(tmp_path, _upload(moto_s3, SHAKESPEARE.read_text()))
    k8s = compute(CPU_ONE_NODE)
    c = api.cluster

    def controller(c):
        _play_job_controller(c, _job_name(c), tmp_path)

    sim = Cluster(controller, c)
    sim.start()
    first = prepare_sources(data, k8s, "tiny").sources["plays"]
    sim.join(timeout=300)
    assert not first.cached and remote_root.is_done(first.root)
    assert _bucket_files(moto_s3, first.root, tmp_path) == _local_reference(tmp_path)
    assert c.names() == []  # the Job and its pods deleted once done
    (job_name,) = [name for kind, name in c.creates if kind == "Job"]

    # A partition lost its marker (a pod killed between its upload and its marker): the rerun's Job holds it alone.
    prefix = first.root.removeprefix(f"s3://{BUCKET}/")
    moto_s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/_DONE")
    moto_s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/parts/00003/_DONE")
    specs = []
    sim = Cluster(lambda c: _play_job_controller(c, _job_name_after(c, job_name), tmp_path, specs), c)
    sim.start()
    again = prepare_sources(data, k8s, "tiny").sources["plays"]
    sim.join(timeout=300)
    assert [s["completions"] for s in specs] == [1]
    assert remote_root.read_provenance(again.root)["partitions_reused"] == 4
    assert _bucket_files(moto_s3, again.root, tmp_path) == _local_reference(tmp_path)


def _job_name_after(c, first: str) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        jobs = [name for kind, name in c.creates if kind == "Job" and name != first]
        if jobs:
            return jobs[-1]
        time.sleep(0.2)
    raise AssertionError("no second Job was created")


@pytest.mark.slow
def test_bad_input_in_fail_mode_ends_the_job_in_one_line_naming_the_file_and_line_and_publishes_nothing(
    tmp_path, moto_s3, api, prefect_harness
):
    from flows.prepare import prepare_sources

    moto_s3.create_bucket(Bucket=BUCKET)
    text = SHAKESPEARE.read_text()[:300_000]
    cut = text.index("\n\n", 250_000)
    bad = (text[:cut] + "\n\nA speech with a bad byte: \udcff here" + text[cut:]).encode("utf-8", "surrogateescape")
    moto_s3.put_object(Bucket=BUCKET, Key="corpora/bad.txt", Body=bad)
    data = _data(tmp_path, f"s3://{BUCKET}/corpora/bad.txt")
    line = bad[: bad.index(b"\xff")].count(b"\n") + 1

    sim = Cluster(lambda c: _play_job_controller(c, _job_name(c), tmp_path), api.cluster)
    sim.start()
    with pytest.raises(DataError) as err:
        prepare_sources(data, compute(CPU_ONE_NODE), "tiny")
    sim.join(timeout=300)
    assert str(err.value) == f"s3://{BUCKET}/corpora/bad.txt:{line}: invalid UTF-8 (byte 0xff)"
    plan = pipeline.plan(data.sources[0], data, _published_tokenizer(data))
    assert not remote_root.is_done(plan.home.where)  # nothing published
    assert api.cluster.names() == []
