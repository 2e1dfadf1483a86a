"""`tessera deploy`: publish prefect.yaml's deployments to the Prefect server in PREFECT_API_URL.

prefect.yaml is the one source of truth: tessera reads it only to pick deployments, to learn each
work pool's type (declared once under `definitions.work_pools`) and to create a missing pool; the
deployments themselves are made by Prefect's own `prefect deploy`, so `tessera deploy` and
`prefect --no-prompt deploy --all` produce the same thing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cli.forms import bounds_the_ui_checks, recipe_schema

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = "prefect.yaml"

# Worker types that live in their own Prefect integration package, by work pool type.
WORKER_PACKAGES = {"kubernetes": "prefect-kubernetes", "docker": "prefect-docker"}

# Prefect's client reports usage unless told not to; tessera runs offline by design.
QUIET_ENV = {"DO_NOT_TRACK": "true"}


class DeployError(RuntimeError):
    """prefect.yaml, a name, a pool or the server cannot be used; str() is one line."""


@dataclass(frozen=True)
class PoolSpec:
    name: str
    type: str
    description: str | None = None


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    entrypoint: str
    pool: str
    raw: dict[str, Any]  # the entry as written (anchors resolved): what `prefect deploy` reads


@dataclass(frozen=True)
class Project:
    """What tessera needs from prefect.yaml."""

    root: Path
    raw: dict[str, Any]
    pools: dict[str, PoolSpec]
    deployments: dict[str, DeploymentSpec]


@dataclass(frozen=True)
class Deployed:
    flow_name: str
    name: str
    id: str
    url: str


def load_project(root: Path = PROJECT_ROOT) -> Project:
    """Read and check prefect.yaml: the checks `prefect deploy` would only warn about, or skip over."""
    from prefect.cli.deploy._models import PrefectYamlModel  # the schema `prefect deploy` validates with
    from pydantic import ValidationError

    path = root / PREFECT_FILE
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DeployError(f"{path}: not found (tessera deploys from a source checkout)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise DeployError(
            f"{path}{f':{mark.line + 1}' if mark else ''}: invalid YAML: {getattr(exc, 'problem', exc)}"
        ) from None
    if not isinstance(raw, dict):
        raise DeployError(f"{path}: expected a mapping at the top level")
    try:
        PrefectYamlModel.model_validate(raw)
    except ValidationError as exc:
        # a union reports one error per branch: the one reaching deepest into the file is the useful one
        where, msg = max(((_written_path(raw, e["loc"]), e["msg"]) for e in exc.errors()), key=lambda e: len(e[0]))
        raise DeployError(f"{path}: {'.'.join(map(str, where))}: {msg}") from None

    pools: dict[str, PoolSpec] = {}
    definitions = raw.get("definitions") or {}
    declared = definitions.get("work_pools") if isinstance(definitions, dict) else None
    if not isinstance(declared, dict):
        raise DeployError(f"{path}: definitions.work_pools: expected a mapping of work pools (name and type each)")
    for key, pool in declared.items():
        if not isinstance(pool, dict) or not isinstance(pool.get("name"), str) or not isinstance(pool.get("type"), str):
            raise DeployError(f"{path}: definitions.work_pools.{key}: needs a name and a type")
        pools[pool["name"]] = PoolSpec(pool["name"], pool["type"], pool.get("description"))

    deployments: dict[str, DeploymentSpec] = {}
    for i, entry in enumerate(raw.get("deployments") or []):
        name, entrypoint = entry.get("name"), entry.get("entrypoint")
        pool = (entry.get("work_pool") or {}).get("name")
        if not name or not entrypoint or not pool:
            raise DeployError(f"{path}: deployments.{i}: needs a name, an entrypoint and a work_pool")
        if name in deployments:
            raise DeployError(f"{path}: deployments.{i}: a second deployment named {name!r}")
        if pool not in pools:
            raise DeployError(
                f"{path}: deployments.{i} ({name}): work pool {pool!r} is not under definitions.work_pools"
            )
        deployments[name] = DeploymentSpec(name, entrypoint, pool, entry)
    if not deployments:
        raise DeployError(f"{path}: declares no deployments")
    return Project(root, raw, pools, deployments)


def _written_path(raw: Any, loc: tuple) -> tuple:
    """The part of a pydantic error location that names keys of the file (not union branch tags)."""
    path, node = [], raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            continue
        path.append(part)
    return tuple(path)


def reachable_api_url() -> str:
    """The Prefect server this process talks to, once it has answered."""
    import httpx
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise DeployError("no Prefect server configured (PREFECT_API_URL is not set); start one with `tessera up`")
    try:
        httpx.get(f"{url}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DeployError(
            f"the Prefect server at {url} does not answer ({reason}); start one with `tessera up`"
        ) from None
    return url


def ensure_pool(project: Project, name: str) -> None:
    """Create work pool `name` unless the server has it; its type comes from prefect.yaml."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.base import BaseWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return
        except ObjectNotFound:
            pass
        spec = project.pools.get(name)
        if spec is None:
            raise DeployError(
                f"work pool {name!r} is neither on the server nor under definitions.work_pools in {PREFECT_FILE}"
            )
        # the installed worker class owns the pool's job template; Prefect's online registry is not consulted (offline)
        worker = BaseWorker.get_worker_class_from_type(spec.type)
        if worker is None:
            package = WORKER_PACKAGES.get(spec.type)
            hint = f"needs the {package} package: pip install {package}" if package else "has no installed worker"
            raise DeployError(f"work pool {name!r} is of type {spec.type!r}, which {hint}")
        try:
            client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type=spec.type,
                    description=spec.description,
                    base_job_template=worker.get_default_base_job_template(),
                )
            )
        except ObjectAlreadyExists:  # created by a worker or a second deploy meanwhile: same pool
            pass


def _selected(project: Project, names: list[str]) -> list[DeploymentSpec]:
    unknown = [n for n in names if n not in project.deployments]
    if unknown:
        raise DeployError(
            f"unknown deployment {unknown[0]!r}; {PREFECT_FILE} declares: {', '.join(project.deployments)}"
        )
    return [project.deployments[n] for n in dict.fromkeys(names)] if names else list(project.deployments.values())


def _last_line(output: str) -> str:
    lines = [ln.strip(" │╭╮╰╯─") for ln in output.splitlines()]
    lines = [ln for ln in lines if ln and ln != "An exception occurred."]
    return lines[-1] if lines else "no output"


def recipe_default(recipe: str, root: Path = PROJECT_ROOT) -> str:
    """The recipe as a form's default: relative to the checkout when inside it (flow runs start there, and the
    form stays readable), else absolute."""
    path = Path(recipe).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def with_recipe(raw: dict[str, Any], recipe: str | None) -> dict[str, Any]:
    """A deployment entry whose form defaults to `recipe` wherever prefect.yaml names one (params.recipe), and
    whose New Data default is the folder's whole path: the one folder a person puts files in, where `data/incoming`
    said nothing of which machine's checkout it meant."""
    params = (raw.get("parameters") or {}).get("params")
    if not isinstance(params, dict):
        return raw
    fresh = dict(params)
    if recipe is not None and "recipe" in params:
        fresh["recipe"] = recipe_default(recipe)
    new_data = params.get("new_data")
    if isinstance(new_data, str) and "://" not in new_data and not Path(new_data).is_absolute():
        fresh["new_data"] = str((PROJECT_ROOT / new_data).resolve())
    if fresh == params:
        return raw
    return {**raw, "parameters": {**raw["parameters"], "params": fresh}}


def _constrain(specs: list[DeploymentSpec], deployed: list[Deployed], recipe: str | None) -> None:
    """Each published form's schema as the UI checks it (bounds_the_ui_checks), and, where the form takes a
    recipe, bounded by `recipe` (recipe_schema)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    from tasks.recipe import load_recipe

    loaded = load_recipe(recipe) if recipe is not None else None
    with get_client(sync_client=True) as client:
        for spec, published in zip(specs, deployed, strict=True):
            found = client.read_deployment(published.id)
            schema = found.parameter_openapi_schema or {}
            names_recipe = "recipe" in ((spec.raw.get("parameters") or {}).get("params") or {})
            if loaded is not None and names_recipe:
                schema = recipe_schema(schema, loaded)
            schema = bounds_the_ui_checks(schema)
            if schema != found.parameter_openapi_schema:
                client.update_deployment(found.id, DeploymentUpdate(parameter_openapi_schema=schema))


def _run_prefect_deploy(
    project: Project,
    specs: list[DeploymentSpec],
    pool: str | None,
    url: str,
    log: Path | None,
    recipe: str | None = None,
) -> None:
    """`prefect --no-prompt deploy --all` over a copy of prefect.yaml holding only `specs`.

    The copy is how a pool override reaches every deployment: with more than one deployment
    `prefect deploy` ignores `--pool` (and every other flag). It runs from the project root because
    Prefect's default pull step records that directory as the flow runs' working directory.
    """
    chosen = [
        with_recipe(s.raw if pool is None else {**s.raw, "work_pool": {**s.raw["work_pool"], "name": pool}}, recipe)
        for s in specs
    ]
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"]
    if len(specs) == 1:
        # a single deployment goes through `prefect deploy`'s single path, where a configured default
        # work pool (PREFECT_DEFAULT_WORK_POOL_NAME) would override prefect.yaml's: name it explicitly
        command += ["--pool", chosen[0]["work_pool"]["name"]]
    with tempfile.TemporaryDirectory(prefix="tessera-deploy-") as tmp:
        prefect_file = Path(tmp) / PREFECT_FILE
        prefect_file.write_text(yaml.safe_dump({**project.raw, "deployments": chosen}, sort_keys=False))
        done = subprocess.run(
            command + ["--prefect-file", str(prefect_file)],
            cwd=project.root,
            env={**os.environ, **QUIET_ENV, "PREFECT_API_URL": url},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
    output = done.stdout + done.stderr
    if log is not None:
        log.write_text(output)
    if done.returncode != 0:
        raise DeployError(
            f"prefect deploy failed (exit {done.returncode}): {_last_line(output)}" + (f"; see {log}" if log else "")
        )


def _published(specs: list[DeploymentSpec]) -> list[Deployed]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import get_current_settings

    ui = get_current_settings().ui_url
    with get_client(sync_client=True) as client:
        found = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[s.name for s in specs])), limit=200
        )
        deployed = []
        for spec in specs:
            # a deployment name is unique per flow only: the entrypoint says which flow's it is
            match = next((d for d in found if d.name == spec.name and d.entrypoint == spec.entrypoint), None)
            if match is None:
                raise DeployError(f"prefect deploy finished but the server has no deployment {spec.name!r}")
            deployed.append(
                Deployed(
                    client.read_flow(match.flow_id).name,
                    spec.name,
                    str(match.id),
                    f"{ui}/deployments/deployment/{match.id}",
                )
            )
    return deployed


def deploy(
    names: list[str] | None = None,
    pool: str | None = None,
    *,
    log: Path | None = None,
    project: Project | None = None,
    recipe: str | None = None,
) -> list[Deployed]:
    """Publish the named deployments (default: all) to the server in PREFECT_API_URL, creating
    missing work pools; `pool` moves them all to that pool, `recipe` makes it every form's default recipe (the
    one whose MLflow store `tessera up` serves). Raises DeployError (one line)."""
    project = project or load_project()
    specs = _selected(project, names or [])
    url = reachable_api_url()
    for name in dict.fromkeys([pool] if pool else [s.pool for s in specs]):
        ensure_pool(project, name)
    from tasks.slots import ensure_names_lock

    ensure_names_lock()  # run names' slots are created through it (tasks/runs/run_slot.py)
    _run_prefect_deploy(project, specs, pool, url, log, recipe)
    deployed = _published(specs)
    _constrain(specs, deployed, recipe)
    return deployed
