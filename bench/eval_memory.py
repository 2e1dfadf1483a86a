"""Peak memory of loading a checkpoint for evaluation and export, at the 125M preset.

Writes one real Composer checkpoint of tessera's 125M model (trainers/model.py) after one AdamW
step, so it holds the optimizer's two moments beside the weights, then loads it for evaluation in a
fresh process two ways and reads each process's peak RSS:

- `full`: the anchor, `torch.load` of the whole file (what evaluation and export did before);
- `mmap`: `trainers.format.export.load_hf`, which memory-maps the file and reads only the model.

Then the whole of what the pipeline runs per checkpoint: the `evaluate_checkpoint` and
`register_checkpoint` Prefect tasks in one flow (a temporary Prefect API in its own process, a
sqlite MLflow store, the demo's three gauntlet tasks over their first 12 records), in a fresh
process of this tree (`task_mb`) and, with `--before REV`, of that commit checked out in a
temporary git worktree (`task_before_mb`; 9f5320a is the last commit before the memory-mapped load).

Prints one JSON line last: the peaks in MB, their ratios, the checkpoint and model sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/tokenize.py would shadow the standard library's tokenize for everything imported below.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from tests.support.gauntlet import cut_demo_tasks

# A child's own peak RSS, printed as its last line. VmHWM, not ru_maxrss: Linux carries ru_maxrss
# across execve, so a child of this process (which has just trained the 125M model) would report
# this process's peak, whatever it loads itself.
HWM = "int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))"

LOAD = {
    "full": "import torch; s = torch.load(sys.argv[1], map_location='cpu', weights_only=False); "
    "from trainers.format.export import load_hf; from trainers.format import safe_load; "
    "safe_load.load = lambda *a, **k: s; m, t = load_hf(sys.argv[1])",
    "mmap": "from trainers.format.export import load_hf; m, t = load_hf(sys.argv[1])",
}


def _write_checkpoint(folder: Path, preset: str) -> tuple[Path, int]:
    import torch
    from composer import Trainer
    from transformers import AutoTokenizer

    from tests.support.training import write_hf_tokenizer
    from trainers.build import _wrap
    from trainers.model import PRESETS, build_model

    tok_dir = write_hf_tokenizer(folder / "tok")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    hf_model = build_model(PRESETS[preset], len(tokenizer), 256, 0, seed=1)
    params = sum(p.numel() for p in hf_model.parameters())
    model = _wrap(hf_model, tokenizer)
    ids = torch.randint(0, len(tokenizer), (2, 64))
    trainer = Trainer(
        model=model,
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-4),
        train_dataloader=torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=2),
        max_duration="1ba",
        save_folder=str(folder),
        save_filename="ckpt.pt",
        save_interval="1ba",
        device="cpu",
        progress_bar=False,
        loggers=[],
    )
    trainer.fit()
    trainer.close()
    return folder / "ckpt.pt", params


def _peak_mb(kind: str, path: Path) -> float:
    code = f"import re, sys; {LOAD[kind]}; print({HWM})"
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024  # kB


# Run with the tree under test first on sys.path; uses only what both trees have: the two tasks,
# CheckpointInfo, EvalConfig and TrackingConfig.
TASKS = (
    """
import re, sys
tree, ckpt, data_root, work = sys.argv[1:]
sys.path.insert(0, tree)
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.testing.utilities import prefect_test_harness

from evaluation.config import EvalConfig
from tasks.gauntlet.evaluate import evaluate_checkpoint
from tasks.registry.register import register_checkpoint
from tasks.tracking_config import TrackingConfig
from trainers.format.checkpoints import CheckpointInfo

import tasks
assert tasks.__file__.startswith(tree), f"imported {tasks.__file__}, not the tree under test {tree}"
uri = f"sqlite:///{work}/mlflow.db"
client = MlflowClient(uri)
run_id = client.create_run(client.create_experiment("bench", artifact_location=f"{work}/artifacts")).info.run_id
tracking = TrackingConfig(tracking_uri=uri, registered_model="bench-125m")
cfg = EvalConfig(every=1, tasks=f"{tree}/configs/gauntlet/tiny_tasks.yaml",
                 gauntlet=f"{tree}/configs/gauntlet/tiny_gauntlet.yaml", data_root=data_root, batch_size=8)
info = CheckpointInfo(path=ckpt, tokens=128, batch=1, stage="s0", stage_index=0)

@flow(name="bench-evaluate-register")
def both():
    summary = evaluate_checkpoint(info, cfg, tracking, run_id, 256, "bench")
    return register_checkpoint(info, summary, tracking, run_id, "bench")

with prefect_test_harness(server_startup_timeout=120):
    registration = both()
assert registration.version == 1, registration
"""
    + f"print({HWM})\n"
)


def _task_peak_mb(tree: Path, path: Path, data_root: Path, work: Path) -> float:
    work.mkdir()
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run(
        [sys.executable, "-c", TASKS, str(tree), str(path), str(data_root), str(work)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"evaluate+register in {tree} failed:\n{out.stderr[-4000:]}")
    return int(out.stdout.split()[-1]) / 1024  # kB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="commit whose evaluate+register tasks are the anchor (e.g. 9f5320a)")
    args = parser.parse_args()
    preset = os.environ.get("TESSERA_BENCH_PRESET", "125m")
    with tempfile.TemporaryDirectory(prefix="tessera-bench-mem-") as tmp:
        path, params = _write_checkpoint(Path(tmp), preset)
        full = _peak_mb("full", path)
        mapped = _peak_mb("mmap", path)
        # the demo's task files cut to 12 records: the load and export dominate, not the scoring
        data_root = cut_demo_tasks(ROOT / "data" / "gauntlet" / "eval" / "local_data", Path(tmp) / "gauntlet")
        task = _task_peak_mb(ROOT, path, data_root, Path(tmp) / "after")
        line = {
            "bench": "eval_memory",
            "preset": preset,
            "params_m": round(params / 1e6, 1),
            "checkpoint_mb": round(path.stat().st_size / 2**20),
            "model_fp32_mb": round(4 * params / 2**20),
            "peak_rss_full_mb": round(full),
            "peak_rss_mmap_mb": round(mapped),
            "ratio": round(mapped / full, 3),
            "task_mb": round(task),
        }
        if args.before:
            old = Path(tmp) / "before-tree"
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), args.before], cwd=ROOT, check=True)
            try:
                before = _task_peak_mb(old, path, data_root, Path(tmp) / "before")
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=True)
            line.update(before=args.before, task_before_mb=round(before), task_ratio=round(task / before, 3))
        print(json.dumps(line))


if __name__ == "__main__":
    main()
