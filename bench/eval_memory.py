"""Peak memory of loading a checkpoint for evaluation and export, at the 125M preset.

Writes one real Composer checkpoint of tessera's 125M model (trainers/model.py) after one AdamW
step, so it holds the optimizer's two moments beside the weights, then loads it for evaluation in a
fresh process two ways and reads each process's peak RSS:

- `full`: the anchor, `torch.load` of the whole file (what evaluation and export did before);
- `mmap`: `trainers.export.load_hf`, which memory-maps the file and reads only the model.

Prints one JSON line last: both peaks in MB, their ratio, the checkpoint and model sizes.
"""

from __future__ import annotations

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

LOAD = {
    "full": "import torch; s = torch.load(sys.argv[1], map_location='cpu', weights_only=False); "
            "from trainers.export import load_hf; import trainers.export as e; "
            "e.torch.load = lambda *a, **k: s; m, t = load_hf(sys.argv[1])",  # fmt: skip
    "mmap": "from trainers.export import load_hf; m, t = load_hf(sys.argv[1])",
}


def _write_checkpoint(folder: Path, preset: str) -> tuple[Path, int]:
    import torch
    from composer import Trainer

    from trainers.build import _wrap
    from trainers.model import PRESETS, build_model
    from trainers.testing import write_hf_tokenizer
    from transformers import AutoTokenizer

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
        max_duration="1ba", save_folder=str(folder), save_filename="ckpt.pt", save_interval="1ba",
        device="cpu", progress_bar=False, loggers=[],
    )  # fmt: skip
    trainer.fit()
    trainer.close()
    return folder / "ckpt.pt", params


def _peak_mb(kind: str, path: Path) -> float:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve, so a child of this process (which
    # has just trained the 125M model) would report this process's peak, whatever it loads itself.
    hwm = "int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))"
    code = f"import re, sys; {LOAD[kind]}; print({hwm})"
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024  # kB


def main() -> None:
    preset = os.environ.get("TESSERA_BENCH_PRESET", "125m")
    with tempfile.TemporaryDirectory(prefix="tessera-bench-mem-") as tmp:
        path, params = _write_checkpoint(Path(tmp), preset)
        full = _peak_mb("full", path)
        mapped = _peak_mb("mmap", path)
        print(json.dumps({
            "bench": "eval_memory", "preset": preset, "params_m": round(params / 1e6, 1),
            "checkpoint_mb": round(path.stat().st_size / 2**20), "model_fp32_mb": round(4 * params / 2**20),
            "peak_rss_full_mb": round(full), "peak_rss_mmap_mb": round(mapped), "ratio": round(mapped / full, 3),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
