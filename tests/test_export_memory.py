"""Evaluation and export read a checkpoint's model, never its optimizer state (memory at model scale)."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.conftest import ROOT, TensorOps

# Peak RSS of the load alone: imports first, then the kernel's high-water mark is reset (clear_refs 5).
PEAK = """
import re, sys
from trainers.format.export import load_hf
from pathlib import Path
Path("/proc/self/clear_refs").write_text("5")
model, tok = load_hf(sys.argv[1])
hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(sum(p.numel() for p in model.parameters()), hwm)
"""


def _load_in_a_fresh_process(path) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-c", PEAK, str(path)], cwd=ROOT, capture_output=True, text=True, check=True)
    params, peak_kib = out.stdout.split()[-2:]
    return int(params), int(peak_kib) / 1024


def _small_checkpoint(folder) -> tuple:
    """(checkpoint path, tokenizer): the tiny model after one AdamW step, as the trainer saves it."""
    from composer import Trainer
    from transformers import AutoTokenizer

    from tests.support.training import write_hf_tokenizer
    from trainers.build import _wrap
    from trainers.config import ModelConfig
    from trainers.model import build_model

    tok = AutoTokenizer.from_pretrained(write_hf_tokenizer(folder / "tok", vocab_size=512))
    model = _wrap(build_model(ModelConfig(), len(tok), 32, 0, seed=1), tok)
    rows = torch.randint(0, len(tok), (2, 16))
    Trainer(
        model=model,
        optimizers=torch.optim.AdamW(model.parameters()),
        device="cpu",
        progress_bar=False,
        train_dataloader=torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=2),
        max_duration="1ba",
        save_folder=str(folder),
        save_filename="small.pt",
        save_interval="1ba",
        loggers=[],
    ).fit()
    return folder / "small.pt", tok


def test_loading_for_evaluation_takes_the_mapped_weights_as_they_are(tmp_path):
    """No init kernel and no copy: the memory-mapped tensors become the parameters (one copy in memory)."""
    from trainers.config import ModelConfig
    from trainers.format.export import load_hf
    from trainers.model import build_model

    path, tok = _small_checkpoint(tmp_path)
    with TensorOps() as seen:
        model, _ = load_hf(path)
    assert not seen.ops & {"normal_", "uniform_", "copy_"}, sorted(seen.ops)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied

    # The same logits as the plain way: a model built with its init, then the weights copied in.
    reference = build_model(ModelConfig(), len(tok), 32, 0, seed=2)
    state = torch.load(path, map_location="cpu", weights_only=False)["state"]["model"]
    reference.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    ids = torch.randint(0, len(tok), (2, 16))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference.eval()(ids).logits)


def test_loading_for_evaluation_skips_the_optimizer_state(tmp_path):
    _small_checkpoint(tmp_path)
    # The same checkpoint with 512 MiB more optimizer state, as a large model's moments would be.
    state = torch.load(tmp_path / "small.pt", map_location="cpu", weights_only=False)
    state["state"]["optimizers"]["AdamW"]["state"]["padding"] = {"exp_avg": torch.ones(128 * 2**20)}
    torch.save(state, tmp_path / "large.pt")
    del state

    params, small = _load_in_a_fresh_process(tmp_path / "small.pt")
    same, large = _load_in_a_fresh_process(tmp_path / "large.pt")
    assert params == same
    assert large - small < 128, f"peak RSS {small:.0f} MB -> {large:.0f} MB: the optimizer state was read"
