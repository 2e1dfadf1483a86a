"""The recipes a team starts from: configs/gpt-125m.yaml, configs/k8s-1b.yaml and configs/k8s-7b.yaml.

Each loads through the real recipe loader; the figures its opening comment states (parameters, token budget,
tokens per step, steps, checkpoint size) are those of the model the repo builds (on the meta device) and of its
curriculum; and `tessera k8s render` of the Kubernetes ones prints objects that validate against the official
schemas (tests/test_k8s_manifests.py's way) and carry the recipe's nodes, GPUs, queue and parallelism.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from tokenizers import Tokenizer

from cli.main import main
from infra.backends import backend_for
from infra.kube_names import Workload
from infra.local import LocalBackend
from infra.manifests import eval_job
from infra.pod_spec import JOB_FILE, POD_SAVE_FOLDER
from tasks.data.results import PreparedData, PreparedSource
from tasks.data.tokenizer import TokenizerInfo, token_dtype
from tasks.recipe import Recipe, load_recipe
from tasks.training.train_job import make_job, write_job
from tests.conftest import ROOT
from tests.test_k8s_manifests import K8S_VERSIONS, _by_kind, _core_objects
from tests.test_k8s_manifests import jobset_schema as _jobset_schema_fixture
from trainers.config import CHECKPOINT_BYTES_PER_PARAM, MlflowTarget, ModelConfig, TrainJob
from trainers.model import PRESETS, build_model_on_meta
from trainers.sharding import is_sharded

# The JobSet v0.12.0 CRD's openAPIV3Schema, found (or the test skipped, saying where it looked) as that module does.
jobset_schema = _jobset_schema_fixture

RECIPES = {name: ROOT / "configs" / f"{name}.yaml" for name in ("gpt-125m", "k8s-1b", "k8s-7b")}
PRESET_OF = {"gpt-125m": "125m", "k8s-1b": "1b", "k8s-7b": "7b"}
# What each Kubernetes recipe promises: nodes, GPUs a node, Kueue queue, sharding, activation checkpointing.
ON_KUBERNETES = {
    "k8s-1b": (2, 8, "team-a", "FULL_SHARD", False),
    "k8s-7b": (8, 8, "team-a", "HYBRID_SHARD", True),
}


@pytest.fixture(autouse=True)
def _in_the_project_root(monkeypatch):
    # A recipe's relative paths (the tokenizer) resolve against the directory tessera runs from.
    monkeypatch.chdir(ROOT)


def _load(name: str) -> Recipe:
    return load_recipe(RECIPES[name])


def _tokenizer(recipe: Recipe) -> tuple[int, int]:
    """(vocabulary size, EOS id) as the prepare stage reads them (tasks/data/tokenizer.py)."""
    tok = Tokenizer.from_file(recipe.data.tokenizer.path)
    return tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(recipe.data.tokenizer.eos_token)


def _stated(path: Path) -> dict[str, float]:
    """The figures the recipe's opening comment states."""
    head = path.read_text().split("\nname:", 1)[0]

    def figure(pattern: str) -> tuple[float, ...]:
        match = re.search(rf"^#\s+{pattern}", head, re.MULTILINE)
        assert match, f"{path.name}: no line matching {pattern!r} in its opening comment"
        return tuple(float(g.replace(",", "")) for g in match.groups())

    (params,) = figure(r"Parameters:\s+([\d,]+) \(")
    (budget,) = figure(r"Token budget:\s+([\d,]+) tokens")
    per_step, batch, seq_len = figure(r"Tokens per step:\s+([\d,]+) = global batch (\d+) x seq_len (\d+)")
    (steps,) = figure(r"Steps:\s+([\d,]+)\s*$")
    (checkpoint_gb,) = figure(r"Checkpoint size:\s+~([\d.]+) GB = 12 bytes a parameter")
    return {
        "params": params,
        "budget": budget,
        "per_step": per_step,
        "batch": batch,
        "seq_len": seq_len,
        "steps": steps,
        "checkpoint_bytes": checkpoint_gb * 1e9,
    }


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_loads_through_the_recipe_loader_with_its_preset_in_bf16_at_2048(name):
    recipe = _load(name)
    assert recipe.name == name
    assert recipe.model == PRESETS[PRESET_OF[name]]
    assert (recipe.data.seq_len, recipe.train.precision) == (2048, "amp_bf16")
    assert recipe.content_hash() == _load(name).content_hash()  # what the run's recipe_hash tag records


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_opening_comment_states_the_true_size_budget_steps_and_checkpoint(name):
    recipe = _load(name)
    vocab, eos = _tokenizer(recipe)
    model = build_model_on_meta(recipe.model, vocab, recipe.data.seq_len, eos)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    params = sum(p.numel() for p in model.parameters())  # a tied embedding is one parameter, counted once
    stated = _stated(RECIPES[name])

    assert not any(s.global_batch_size or s.seq_len for s in recipe.train.stages)  # one step size for the run
    per_step = recipe.train.global_batch_size * recipe.data.seq_len
    budget = sum(stage.tokens for stage in recipe.train.stages)
    steps = sum(stage.tokens // per_step for stage in recipe.train.stages)
    assert (stated["batch"], stated["seq_len"]) == (recipe.train.global_batch_size, recipe.data.seq_len)
    assert stated["per_step"] == per_step
    assert stated["budget"] == pytest.approx(budget, rel=0.02)
    assert stated["steps"] == pytest.approx(steps, rel=0.02)
    assert stated["params"] == pytest.approx(params, rel=0.02)
    # 12 bytes a parameter: fp32 weights and AdamW's two moments (the preflight's and the watchdog's figure too)
    assert recipe.model.checkpoint_bytes(vocab) == CHECKPOINT_BYTES_PER_PARAM * params
    assert stated["checkpoint_bytes"] == pytest.approx(CHECKPOINT_BYTES_PER_PARAM * params, rel=0.03)
    assert 15 <= budget / params <= 25  # a real budget: about Chinchilla's 20 tokens a parameter


def test_gpt_125m_trains_as_one_unsharded_process_on_the_local_backend():
    recipe = _load("gpt-125m")
    assert recipe.compute.backend == "local" and recipe.compute.kubernetes is None
    assert (recipe.compute.procs_per_node, recipe.compute.ranks_per_node) == (1, 1)
    assert isinstance(backend_for(recipe.compute), LocalBackend)
    assert not is_sharded(recipe.train.parallelism, world_size=1)  # a single-file checkpoint
    assert recipe.train.global_batch_size % recipe.train.device_microbatch_size == 0
    assert main(["k8s", "render", str(RECIPES["gpt-125m"]), "--stage", "0"]) == 2  # not a Kubernetes recipe


def _job_file(recipe: Recipe, folder: Path) -> Path:
    """The job file `tessera run` writes once the data is prepared (tasks/training/train_job.py:make_job), with each
    source and the tokenizer published under the s3:// data root as the prepare stage names them
    (<root>/<source>-<hash>)."""
    vocab, eos = _tokenizer(recipe)
    root = recipe.data.root.rstrip("/")
    dtype = token_dtype(vocab)
    tokenizer = TokenizerInfo(
        hf_dir=str(folder / "tokenizer"),
        vocab_size=vocab,
        eos_token_id=eos,
        dtype=dtype,
        fingerprint="0" * 16,
        uri=f"{root}/tokenizer-0000000000000000",
    )
    sources = {
        s.name: PreparedSource(
            name=s.name,
            path=f"{root}/{s.name}-0000000000000000/train",
            val_path=f"{root}/{s.name}-0000000000000000/val" if s.val_fraction else None,
            root=f"{root}/{s.name}-0000000000000000",
            hash="0000000000000000",
            documents=1,
            tokens=recipe.data.seq_len,
            samples=1,
            dtype=dtype,
        )
        for s in recipe.data.sources
    }
    job = make_job(
        recipe.name,
        recipe.model,
        recipe.train,
        recipe.data.seq_len,
        PreparedData(tokenizer=tokenizer, seq_len=recipe.data.seq_len, sources=sources),
        {},
        recipe.eval.every,
        folder / "runs" / recipe.name,
        MlflowTarget(tracking_uri=recipe.tracking.tracking_uri, run_id="0" * 32),
    )
    return write_job(job, folder / "job.json")


def _render(name: str, stage: int, job: Path, capsys) -> list[dict]:
    """`tessera k8s render RECIPE --stage K --job JOB`, as a person types it."""
    capsys.readouterr()
    assert main(["k8s", "render", str(RECIPES[name]), "--stage", str(stage), "--job", str(job)]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


@pytest.mark.parametrize("name", sorted(ON_KUBERNETES))
def test_k8s_render_of_every_stage_gives_core_objects_that_validate(name, tmp_path, capsys):
    recipe = _load(name)
    job = _job_file(recipe, tmp_path)
    evaluation = eval_job(
        recipe.compute.kubernetes,
        Workload(recipe.name, "eval", tokens=recipe.eval.every),
        "evaluation",
        ["--checkpoint", f"{recipe.train.save_folder}/{recipe.name}/checkpoint", "--step", str(recipe.eval.every)],
    )
    for stage in range(len(recipe.train.stages)):
        objects = _render(name, stage, job, capsys)
        assert [o["kind"] for o in objects] == ["NetworkPolicy", "ConfigMap", "JobSet"]
        core = _core_objects(objects) + [evaluation]
        assert sorted(o["kind"] for o in core) == ["ConfigMap", "Job", "Job", "NetworkPolicy"]
        for version in K8S_VERSIONS:
            for obj in core:
                kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", sorted(ON_KUBERNETES))
def test_k8s_render_of_every_stage_gives_a_jobset_the_release_crd_accepts(name, tmp_path, capsys, jobset_schema):
    recipe = _load(name)
    job = _job_file(recipe, tmp_path)
    for stage in range(len(recipe.train.stages)):
        jsonschema.validate(_by_kind(_render(name, stage, job, capsys))["JobSet"], jobset_schema)


@pytest.mark.parametrize("name", sorted(ON_KUBERNETES))
def test_k8s_render_on_a_fresh_checkout_needs_only_the_recipe(name, tmp_path, capsys, jobset_schema):
    """No data prepared, no run started: every stage's objects from the recipe, valid, with what only the prepare
    stage can know marked as such; the same job file the hand-built one above holds where it can know."""
    raw = yaml.safe_load(RECIPES[name].read_text())
    raw["work_dir"] = str(tmp_path / "work")  # nothing `tessera run` wrote
    fresh = tmp_path / f"{name}.yaml"
    fresh.write_text(yaml.safe_dump(raw))
    recipe = _load(name)
    for stage in range(len(recipe.train.stages)):
        capsys.readouterr()
        assert main(["k8s", "render", str(fresh), "--stage", str(stage)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"# tessera: from {fresh} alone (no job file at {tmp_path / 'work' / 'runs' / name}")
        objects = _by_kind(list(yaml.safe_load_all(out)))
        for version in K8S_VERSIONS:
            for obj in _core_objects(list(objects.values())):
                kubernetes_validate.validate(obj, version, strict=True)
        jsonschema.validate(objects["JobSet"], jobset_schema)
        planned = json.loads(objects["ConfigMap"]["data"][JOB_FILE])
        hand = json.loads(_job_file(recipe, tmp_path / "hand").read_text())
        for field in ("run_name", "model", "vocab_size", "eos_token_id", "seq_len", "checkpoint_every_tokens"):
            assert planned[field] == hand[field], field
        pod_own = {"save_folder": None, "stream_cache_limit": None}  # the pod's disk, set by infra/pod_spec.py
        assert planned["train"] | pod_own == hand["train"] | pod_own
        assert all(p.endswith("-{prepare-hash}/train") for p in planned["streams"].values())


@pytest.mark.parametrize("name", sorted(ON_KUBERNETES))
def test_the_rendered_jobset_runs_the_recipes_nodes_gpus_queue_and_parallelism(name, tmp_path, capsys):
    nodes, gpus, queue, sharding, recompute = ON_KUBERNETES[name]
    recipe = _load(name)
    last = len(recipe.train.stages) - 1
    objects = _by_kind(_render(name, last, _job_file(recipe, tmp_path), capsys))
    js = objects["JobSet"]
    assert js["metadata"]["name"] == f"tessera-{name}-s{last}-a0"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == queue
    (replicated,) = js["spec"]["replicatedJobs"]
    group = replicated["template"]["spec"]
    assert (replicated["replicas"], group["completions"], group["parallelism"]) == (1, nodes, nodes)
    pod = group["template"]["spec"]
    (trainer,) = pod["containers"]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert trainer["command"][3:7] == ["--nproc-per-node", str(gpus), "--nnodes", str(nodes)]
    assert trainer["command"][-2:] == ["--stage", str(last)]
    scratch = next(v for v in pod["volumes"] if v["name"] == "scratch")
    assert scratch["emptyDir"]["sizeLimit"] == recipe.compute.kubernetes.scratch_size

    # The trainer's job file, as the ConfigMap hands it to every pod
    job = json.loads(objects["ConfigMap"]["data"][JOB_FILE])
    assert job["train"]["parallelism"] == {"sharding": sharding, "activation_checkpointing": recompute}
    assert job["train"]["precision"] == "amp_bf16"
    assert (job["train"]["global_batch_size"], job["seq_len"]) == (recipe.train.global_batch_size, 2048)
    assert ModelConfig.model_validate(job["model"]) == PRESETS[PRESET_OF[name]]
    assert job["save_folder"] == POD_SAVE_FOLDER and job["train"]["save_folder"].startswith("s3://")
    assert sorted(job["streams"]) == sorted(s.name for s in recipe.data.sources)
    assert all(uri.startswith(f"{recipe.data.root}/") for uri in job["streams"].values())
    assert job["tokenizer_dir"].startswith(f"{recipe.data.root}/")
    # Streaming's cache held under the cache emptyDir's sizeLimit (500Gi), past which the kubelet evicts the pod
    assert int(job["train"]["stream_cache_limit"]) == 500 * 2**30 * 9 // 10
    trainer_job = TrainJob.model_validate(job)  # what trainers.train reads in the pod
    assert trainer_job.stage(last).end == sum(s.tokens for s in recipe.train.stages)


def test_the_7b_recipe_keeps_its_pods_off_nodes_labelled_slow(tmp_path, capsys):
    recipe = _load("k8s-7b")
    pod = _by_kind(_render("k8s-7b", 0, _job_file(recipe, tmp_path), capsys))["JobSet"]["spec"]["replicatedJobs"][0]
    required = pod["template"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert required == {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "tessera.dev/avoid", "operator": "DoesNotExist"}]}]
    }


@pytest.mark.parametrize("name", sorted(ON_KUBERNETES))
def test_k8s_render_prepare_on_a_fresh_checkout_gives_the_recipes_cpu_job(name, tmp_path, capsys, monkeypatch):
    """The prepare Job from the recipe alone, its sources out of reach (an endpoint where nothing listens): valid for
    both schemas, on the recipe's own CPU nodes and resources with no GPU, the index file's key a placeholder."""
    for var, value in {
        "S3_ENDPOINT_URL": "http://127.0.0.1:9",  # nothing listens: refused at once, nothing leaves this machine
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(var, value)
    raw = yaml.safe_load(RECIPES[name].read_text())
    raw["work_dir"] = str(tmp_path / "work")
    fresh = tmp_path / f"{name}.yaml"
    fresh.write_text(yaml.safe_dump(raw))
    prep = _load(name).compute.kubernetes.prepare
    assert prep.pods > 1 and prep.cpu and prep.memory and prep.node_selector  # the recipes state them
    assert main(["k8s", "render", str(fresh), "--prepare"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# tessera: from {fresh} alone: the sources could not be planned here (")
    (job,) = [d for d in yaml.safe_load_all(out) if d]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][-1] == "s3://my-bucket/tessera/data/.prepare/{prepare-key}.json"
    assert container["resources"] == {
        "requests": {"cpu": prep.cpu, "memory": prep.memory},
        "limits": {"memory": prep.memory},
    }
    assert pod["nodeSelector"] == prep.node_selector
    assert job["spec"]["backoffLimitPerIndex"] == prep.backoff_limit_per_index
