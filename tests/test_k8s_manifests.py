"""Every manifest tessera generates validates against the API it targets, and says what the issue asks.

Core objects (ConfigMap, Service, Job, and the Job template inside a JobSet) are validated with
kubernetes-validate for Kubernetes 1.29 and for the newest version it ships; the JobSet against
the openAPIV3Schema of JobSet v0.12.0's CRD. No cluster is involved: these are schema checks.
"""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infra.kube_names import Workload
from infra.manifests import eval_job, stage_manifests
from infra.pod_spec import CACHE_DIR, JOB_DIR, JOB_FILE, POD_SAVE_FOLDER, RankLaunch
from tests.conftest import ROOT
from tests.k8s.variants import CPU_ONE_NODE, GPU_KUEUE, GPU_TWO_NODES, INDEXED_JOB, VARIANTS, compute, job_json
from trainers.contract import SUPERVISOR_PID_ENV as SUPERVISOR_ENV
from trainers.contract import WARM_MODULES

K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
JOBSET_RELEASE = "v0.12.0"
_CRD_NAME = "jobset.x-k8s.io_jobsets.yaml"
# Where the JobSet CRD may be: vendored next to the tests, or in the shared folder beside the checkout.
CRD_PLACES = [
    ROOT / "tests" / "k8s" / f"jobset-{JOBSET_RELEASE}" / _CRD_NAME,
    ROOT.parent / "shared" / "k8s" / f"jobset-{JOBSET_RELEASE}" / _CRD_NAME,
]

TRAIN_ARGS = ["--job", f"{JOB_DIR}/{JOB_FILE}", "--stage", "1"]


def _render(raw: dict, run: str = "tiny", stage: int = 1, attempt: int = 0) -> list[dict]:
    cfg = compute(raw)
    work = Workload(run, "train", stage=stage, attempt=attempt)
    return stage_manifests(
        cfg.kubernetes,
        work,
        cfg.ranks_per_node,
        "trainers.train",
        TRAIN_ARGS,
        job_json(run),
        {"TESSERA_HOLDER": "flow run 'x'", SUPERVISOR_ENV: "123"},
        RankLaunch(cfg.restarts_in_place, WARM_MODULES),  # as KubernetesBackend.launch renders it
    )


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


@pytest.fixture(scope="module")
def jobset_schema() -> dict:
    crd_path = next((p for p in CRD_PLACES if p.is_file()), None)
    if crd_path is None:
        pytest.skip(
            f"the JobSet {JOBSET_RELEASE} CRD is not here ({' or '.join(map(str, CRD_PLACES))}): see "
            "docs/KUBERNETES.md, 'Tests'"
        )
    crd = yaml.safe_load(crd_path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return version["schema"]["openAPIV3Schema"]


def _core_objects(objects: list[dict]) -> list[dict]:
    """The core objects, plus the Job a JobSet's replicated job stamps out (validated as a batch/v1 Job)."""
    core = [o for o in objects if o["kind"] != "JobSet"]
    for js in (o for o in objects if o["kind"] == "JobSet"):
        for rj in js["spec"]["replicatedJobs"]:
            core.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {"name": f"{js['metadata']['name']}-{rj['name']}-0", **rj["template"]["metadata"]},
                    "spec": rj["template"]["spec"],
                }
            )
    return core


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_validate(variant, version):
    objects = _core_objects(_render(VARIANTS[variant]))
    cfg = compute(VARIANTS[variant])
    objects.append(eval_job(cfg.kubernetes, Workload("tiny", "eval", tokens=16384), "evaluation", ["--step", "16384"]))
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == (
        ["ConfigMap", "Job", "Job", "NetworkPolicy", "Service"]
        if cfg.kubernetes.api == "indexed-job"
        else ["ConfigMap", "Job", "Job", "NetworkPolicy"]
    )
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    "variant", [v for v in sorted(VARIANTS) if VARIANTS[v]["kubernetes"].get("api") != "indexed-job"]
)
def test_jobset_validates_against_the_release_crd(variant, jobset_schema):
    js = _by_kind(_render(VARIANTS[variant]))["JobSet"]
    jsonschema.validate(js, jobset_schema)
    # and the schema is strict enough to catch a wrong enum: the check is not vacuous
    bad = json.loads(json.dumps(js))
    bad["spec"]["failurePolicy"]["restartStrategy"] = "Rolling"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, jobset_schema)


def test_jobset_shape_command_and_failure_policy():
    objects = _render(GPU_TWO_NODES)
    js = _by_kind(objects)["JobSet"]
    name = "tessera-tiny-s1-a0"
    assert js["metadata"]["name"] == name and js["metadata"]["namespace"] == "training"
    assert js["metadata"]["labels"] == {
        "app.kubernetes.io/name": "tessera",
        "app.kubernetes.io/component": "train",
        "app.kubernetes.io/managed-by": "tessera",
        "tessera.dev/run": "tiny",
        "tessera.dev/stage": "1",
        "tessera.dev/attempt": "0",
    }
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert js["spec"]["failurePolicy"] == {
        "maxRestarts": 4,
        "restartStrategy": "BlockingRecreate",
        "rules": [
            {
                "name": "FatalExitCode",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": ["failed with exit code 78 matching FailJob rule"],
            },
            {
                "name": "Disruption",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching FailJob rule"],
            },
            {  # the pod's watchdog killed a hung group (infra/launcher.py, restarts in place spent): like a disruption
                "name": "Hang",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": ["failed with exit code 79 matching FailJob rule"],
            },
        ],
    }
    (rj,) = js["spec"]["replicatedJobs"]
    assert (rj["name"], rj["replicas"]) == ("node", 1)
    job = rj["template"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == ("Indexed", 2, 2, 0)
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [78]}},
        {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [79]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == [
        "python",
        "-m",
        "infra.launcher",
        "--nproc-per-node",
        "8",
        "--nnodes",
        "2",
        "--node-rank",
        "$(JOB_COMPLETION_INDEX)",
        "--rdzv-endpoint",
        "$(TESSERA_MASTER_ADDR):29500",
        "--local-addr",
        "$(TESSERA_STORE_BIND)",
        "--max-restarts",
        "3",
        "--log-dir",
        "/var/tessera/work/logs",
        "--warm",
        "trainers.build,trainers.metrics_journal,trainers.rollback,trainers.data_check",
        "-m",
        "trainers.train",
        "--job",
        "/etc/tessera/job/job.json",
        "--stage",
        "1",
    ]
    env = {e["name"]: e for e in c["env"]}
    # pod 0's stable name under the JobSet's naming rules: <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>
    assert env["TESSERA_MASTER_ADDR"]["value"] == f"{name}-node-0-0.{name}"
    assert SUPERVISOR_ENV not in env  # no supervisor process in a pod
    assert env["TESSERA_HOLDER"]["value"] == "flow run 'x'"
    assert env["AWS_SECRET_ACCESS_KEY"] == {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "tessera-s3", "key": "secret-key"}},
    }
    assert c["envFrom"] == [{"secretRef": {"name": "mlflow-auth"}}]
    assert env["TESSERA_CACHE_DIR"]["value"] == CACHE_DIR
    assert c["resources"] == {
        "requests": {"cpu": "96", "memory": "1600Gi"},
        "limits": {"memory": "1600Gi", "nvidia.com/gpu": "8"},
    }
    assert c["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "job", "configMap": {"name": name}} in pod["volumes"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ] == [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east5-a"]}]
    assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("training-high", "tessera-trainer")
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["automountServiceAccountToken"] is False
    assert "kueue.x-k8s.io/queue-name" not in js["metadata"]["labels"]
    # the ConfigMap carries the job with the pod's own checkpoint folder
    cm = _by_kind(objects)["ConfigMap"]
    assert json.loads(cm["data"][JOB_FILE])["save_folder"] == POD_SAVE_FOLDER
    # ...and Streaming's cache held under the emptyDir's sizeLimit (500Gi), past which the kubelet evicts
    assert env["TESSERA_CACHE_DIR"]["value"] == CACHE_DIR == "/var/cache/tessera"
    assert int(json.loads(cm["data"][JOB_FILE])["train"]["stream_cache_limit"]) == 500 * 2**30 * 9 // 10
    on_claim = _by_kind(_render(INDEXED_JOB))["ConfigMap"]  # a claim's size is not ours to know: no limit added
    assert json.loads(on_claim["data"][JOB_FILE])["train"].get("stream_cache_limit") is None


def test_no_secret_value_in_any_manifest():
    """Credentials only by reference: the rendered text holds the Secret names, never a key's value."""
    js = _by_kind(_render(GPU_TWO_NODES))["JobSet"]
    env = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    by_ref = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "secretKeyRef" in e.get("valueFrom", {})}
    assert by_ref == {
        "AWS_ACCESS_KEY_ID": {"name": "tessera-s3", "key": "access-key"},
        "AWS_SECRET_ACCESS_KEY": {"name": "tessera-s3", "key": "secret-key"},
        "WANDB_API_KEY": {"name": "wandb", "key": "api-key"},  # compute.kubernetes.secrets
        "HF_TOKEN": {"name": "hf-hub", "key": "token"},
    }
    assert all("value" not in e for e in env if e["name"] in by_ref)
    assert "MLFLOW_TRACKING_PASSWORD" not in json.dumps(js)  # envFrom names the Secret, not its keys
    cfg = compute(GPU_TWO_NODES)  # the evaluation and prepare pods get the same references
    eval_env = eval_job(cfg.kubernetes, Workload("tiny", "eval", tokens=16384), "evaluation", ["--step", "1"])
    eval_refs = [e for e in eval_env["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-hub", "key": "token"}}} in eval_refs
    with pytest.raises(ValueError, match="AWS_SECRET_ACCESS_KEY: looks like a credential"):
        compute(
            {
                **GPU_TWO_NODES,
                "kubernetes": {**GPU_TWO_NODES["kubernetes"], "env": {"AWS_SECRET_ACCESS_KEY": "hunter2"}},
            }
        )


@pytest.mark.parametrize(
    "name, value",
    [
        ("WANDB_API_KEY", "wk-hunter2"),
        ("OPENAI_API_KEY", "sk-hunter2"),
        ("HF_HUB_AUTH", "hunter2"),
        ("MLFLOW_TRACKING_USERNAME", "hunter2"),
        ("GITHUB_TOKEN", "hunter2"),
        ("DATABASE_URL", "postgres://admin:hunter2@db.internal:5432/runs"),
        ("UPLOAD_URI", "https://ci:hunter2@artifacts.example.com/x"),
    ],
)
def test_credential_looking_env_is_refused_by_its_name_or_value_and_the_value_is_never_said(name, value, tmp_path):
    """The recipe's one-line error names the variable and the way (a Secret), never the value."""
    from tasks.recipe import RecipeError, load_recipe

    raw = yaml.safe_load((ROOT / "configs" / "k8s-1b.yaml").read_text())
    raw["compute"]["kubernetes"]["env"] = {name: value}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError) as refused:
        load_recipe(tmp_path / "r.yaml")
    said = str(refused.value)
    assert len(said.splitlines()) == 1 and "compute.kubernetes.env" in said
    assert name in said and "Secret" in said and "hunter2" not in said


def test_secrets_name_their_variables_once_and_mlflow_params_name_no_value(tmp_path):
    """compute.kubernetes.secrets: each Secret names the variables it gives (a secretKeyRef each), a variable
    comes from one place, and MLflow's params say which Secret gives which variable, never a value."""
    from tasks.recipe import RecipeError, load_recipe

    raw = yaml.safe_load((ROOT / "configs" / "k8s-1b.yaml").read_text())
    raw["compute"]["kubernetes"]["secrets"] = [{"name": "wandb", "keys": {"WANDB_API_KEY": "api-key"}}]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    params = load_recipe(tmp_path / "r.yaml").tracked_params()
    assert params["compute.kubernetes.secrets"] == "wandb:WANDB_API_KEY"
    for secrets, said in (
        ([{"name": "wandb"}], "compute.kubernetes.secrets: wandb: name the variables this Secret gives"),
        (
            [{"name": "a", "keys": {"HF_TOKEN": "t"}}, {"name": "b", "keys": {"HF_TOKEN": "u"}}],
            "each variable comes from one place, and these come from two: HF_TOKEN (secrets a and secrets b)",
        ),
        ([{"name": "Not_A_Name", "keys": {"X": "y"}}], "compute.kubernetes.secrets.0.name"),
    ):
        raw["compute"]["kubernetes"]["secrets"] = secrets
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
        with pytest.raises(RecipeError) as refused:
            load_recipe(tmp_path / "r.yaml")
        assert len(str(refused.value).splitlines()) == 1 and said in str(refused.value), str(refused.value)


def test_plain_env_is_accepted_and_only_its_names_become_mlflow_params(tmp_path):
    """A URL without a password, NCCL's settings: accepted, in the manifests, and in MLflow's params by name only."""
    from tasks.recipe import load_recipe

    env = {"AWS_ENDPOINT_URL": "https://s3.example.com", "NCCL_DEBUG": "INFO"}
    raw = yaml.safe_load((ROOT / "configs" / "k8s-1b.yaml").read_text())
    raw["compute"]["kubernetes"]["env"] = env
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    params = load_recipe(tmp_path / "r.yaml").tracked_params()
    assert params["compute.kubernetes.env"] == "AWS_ENDPOINT_URL,NCCL_DEBUG"
    assert not any(k.startswith("compute.kubernetes.env.") for k in params)
    assert "s3.example.com" not in json.dumps(params) and "INFO" not in json.dumps(params)


def test_cpu_variant_and_kueue_label():
    js = _by_kind(_render(CPU_ONE_NODE))["JobSet"]
    c = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][3:7] == ["--nproc-per-node", "2", "--nnodes", "1"]  # procs_per_node ranks on a CPU pod
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] == 1
    kueue = _by_kind(_render(GPU_KUEUE))["JobSet"]
    assert kueue["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


def test_with_avoid_slow_nodes_every_required_node_term_keeps_off_a_labelled_node():
    """The recipe's own required term keeps its zone and gains the label's absence (terms are ORed, so each must);
    without the option the affinity is the recipe's alone; every pod gets its node's name (downward API)."""
    avoid = {"key": "tessera.dev/avoid", "operator": "DoesNotExist"}
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east5-a"]}
    for raw, expected in ((GPU_KUEUE, [zone, avoid]), (GPU_TWO_NODES, [zone])):
        pod = _by_kind(_render(raw))["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert required == {"nodeSelectorTerms": [{"matchExpressions": expected}]}
        (c,) = pod["containers"]
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]
    plain = {**CPU_ONE_NODE, "kubernetes": {**CPU_ONE_NODE["kubernetes"], "avoid_slow_nodes": True}}
    pod = _by_kind(_render(plain))["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["affinity"] == {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [avoid]}
        ]}}
    }  # fmt: skip
    assert "affinity" not in _by_kind(_render(CPU_ONE_NODE))["JobSet"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]  # fmt: skip


def test_indexed_job_fallback_names_pod0_through_its_headless_service():
    objects = _render(INDEXED_JOB, attempt=2)
    assert [o["kind"] for o in objects] == ["NetworkPolicy", "ConfigMap", "Service", "Job"]
    svc, job = objects[2], objects[3]
    name = "tessera-tiny-s1-a2"
    assert svc["metadata"]["name"] == job["metadata"]["name"] == name
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {
        "app.kubernetes.io/name": "tessera",
        "app.kubernetes.io/component": "train",
        "tessera.dev/run": "tiny",
        "tessera.dev/stage": "1",
        "tessera.dev/attempt": "2",
    }
    pod = job["spec"]["template"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in svc["spec"]["selector"].items())
    assert pod["spec"]["subdomain"] == name
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["TESSERA_MASTER_ADDR"] == f"{name}-0.{name}"  # an Indexed Job pod's hostname is <job>-<index>
    assert (job["spec"]["completions"], job["spec"]["parallelism"], job["spec"]["completionMode"]) == (2, 2, "Indexed")
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "streaming-cache"}} in pod["spec"]["volumes"]


def test_names_are_deterministic_and_dns_safe():
    assert Workload("tiny", "train", stage=0, attempt=3).name == "tessera-tiny-s0-a3"
    odd = Workload("My_Run.v2-with-a-really-long-name", "train", stage=12, attempt=1)
    assert odd.name == Workload("My_Run.v2-with-a-really-long-name", "train", stage=12, attempt=1).name
    assert odd.name != Workload("my-run-v2-with-a-really-long-name", "train", stage=12, attempt=1).name
    pod0 = f"{odd.name}-node-0-0"
    assert len(pod0) <= 63 and pod0 == pod0.lower()
    assert odd.labels["tessera.dev/run"] == "My_Run.v2-with-a-really-long-name"  # a valid label value stays as is
    assert Workload("x", "eval", tokens=16384).name == "tessera-x-e16384-a0"


def test_eval_job_is_one_gpu_pod_without_distributed_launcher():
    cfg = compute(GPU_KUEUE).kubernetes
    job = eval_job(cfg, Workload("tiny", "eval", tokens=16384), "evaluation", ["--checkpoint", "s3://b/r/c.pt"])
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "evaluation", "--checkpoint", "s3://b/r/c.pt"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert (job["spec"]["completions"], job["spec"]["backoffLimit"]) == (1, 0)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["labels"]["tessera.dev/stage"] == "tok-16384"


def test_recipe_errors_are_one_line_naming_the_field(tmp_path):
    from tasks.recipe import RecipeError, load_recipe

    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())

    def load(**sections) -> str:
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({**raw, **sections}))
        with pytest.raises(RecipeError) as err:
            load_recipe(path)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert load(compute={"backend": "kubernetes"}).endswith(
        "compute.kubernetes: required with compute.backend: kubernetes (image, nodes, gpus_per_node, ...)"
    )
    k8s = {"backend": "kubernetes", "kubernetes": {"image": "img:1"}}
    assert "data.root: .tessera/data: must be an s3:// URI with compute.backend kubernetes" in load(compute=k8s)
    local_sources = {**raw["data"], "root": "s3://bucket/data"}
    assert "train.save_folder: None: must be an s3:// URI" in load(compute=k8s, data=local_sources)
    s3_train = {**raw["train"], "save_folder": "s3://bucket/ckpt"}
    assert load(compute=k8s, data=local_sources, train=s3_train).endswith(
        "data.sources.0.paths: source 'literary': data/corpora/tinyshakespeare/input.txt is on this machine's disk, "
        "which the prepare Job's pods cannot read with compute.backend kubernetes; use an s3:// path (or a Hugging "
        "Face dataset by name)"
    )
    sources = [{**s, "paths": [f"s3://bucket/corpora/{s['name']}/"]} for s in raw["data"]["sources"]]
    s3_data = {**local_sources, "sources": sources}
    assert "tracking.tracking_uri: sqlite:///.tessera/mlflow.db: pods log to MLflow over the network" in load(
        compute=k8s, data=s3_data, train=s3_train
    )
    bad_gpus = {**k8s, "procs_per_node": 4, "kubernetes": {"image": "img:1", "gpus_per_node": 8}}
    assert "compute.kubernetes: gpus_per_node (8) sets the ranks of a GPU pod" in load(compute=bad_gpus)
    bad_mem = {**k8s, "kubernetes": {"image": "img:1", "memory": "lots"}}
    assert "compute.kubernetes.memory: String should match pattern" in load(compute=bad_mem)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_only_the_groups_own_pods_reach_its_pods_and_the_store_binds_to_the_pod_ip(variant):
    """The NetworkPolicy comes first (no pod exists before it) and admits exactly the launch's pods, which the
    group's pod template labels; rank 0's store listens on the pod's own IP (the downward API)."""
    objects = _render(VARIANTS[variant])
    policy, group = objects[0], objects[-1]
    assert policy["kind"] == "NetworkPolicy"
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    job = group["spec"]["replicatedJobs"][0]["template"] if group["kind"] == "JobSet" else group
    pod = job["spec"]["template"]
    assert selector == {k: v for k, v in pod["metadata"]["labels"].items() if k in selector}
    assert selector["tessera.dev/attempt"] == "0" and selector["tessera.dev/run"] == "tiny"
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["TESSERA_STORE_BIND"] == {
        "name": "TESSERA_STORE_BIND",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
