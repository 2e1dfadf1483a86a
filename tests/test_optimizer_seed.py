"""Continued pretraining starts Adam from the base checkpoint's moments only when they fit the model."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from trainers.optimizer_seed import seed_optimizer


class Net(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = torch.nn.Linear(4, width)
        self.head = torch.nn.Linear(width, 1)


def _checkpoint(tmp_path, width: int) -> str:
    """A file shaped like a Composer checkpoint: optimizer state keyed by parameter name, as Composer saves it."""
    torch.manual_seed(0)
    net = Net(width)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net.head(net.body(torch.randn(8, 4))).sum().backward()
    opt.step()
    saved = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
    path = tmp_path / f"w{width}.pt"
    torch.save({"state": {"optimizers": {"AdamW": saved}}}, path)
    return str(path), saved


def test_matching_shapes_restore_the_moments_and_keep_the_new_lr(tmp_path):
    path, saved = _checkpoint(tmp_path, 8)
    net = Net(8)
    opt = torch.optim.AdamW(net.parameters(), lr=5e-4)
    assert seed_optimizer(net, opt, path) == f"restored from {path}"
    state = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))["state"]
    for name, moments in saved["state"].items():
        assert torch.equal(state[name]["exp_avg"], moments["exp_avg"]), name
        assert torch.equal(state[name]["exp_avg_sq"], moments["exp_avg_sq"]), name
    assert [g["lr"] for g in opt.param_groups] == [5e-4]  # the continued run's schedule, not the base's


def test_other_shapes_or_an_unreadable_file_start_fresh_and_say_why(tmp_path):
    path, _ = _checkpoint(tmp_path, 8)
    net = Net(16)
    opt = torch.optim.AdamW(net.parameters(), lr=5e-4)
    assert seed_optimizer(net, opt, path) == (
        f"fresh: {path} has exp_avg of body.weight shaped (8, 4), the model's is (16, 4)"
    )
    assert opt.state_dict()["state"] == {}
    missing = str(tmp_path / "gone.pt")
    assert seed_optimizer(net, opt, missing).startswith(f"fresh: cannot read the optimizer state of {missing}")


class _OpensAFile:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_stops_the_run_unless_trusted(tmp_path):
    """init_optimizer_from names a file: read weights-only, a payload is a fatal line naming it, not a fresh start
    that would hide it; train.trust_checkpoints loads it (and runs what it carries)."""
    from trainers.exit_codes import FatalError

    path, _ = _checkpoint(tmp_path, 8)
    state = torch.load(path, weights_only=True)
    marker = tmp_path / "payload-ran"
    state["state"]["note"] = _OpensAFile(marker)
    evil = str(tmp_path / "evil.pt")
    torch.save(state, evil)
    net = Net(8)
    opt = torch.optim.AdamW(net.parameters(), lr=5e-4)
    with pytest.raises(FatalError) as refused:
        seed_optimizer(net, opt, evil)
    assert str(refused.value).startswith(
        f"train.init_optimizer_from: {evil}: refused to load: unpickling it needs `io.open`, which can run code"
    )
    assert not marker.exists() and opt.state_dict()["state"] == {}
    assert seed_optimizer(net, opt, evil, trust=True) == f"restored from {evil}"
    assert marker.exists()


def _flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_byte_in_the_source_is_one_fatal_line_with_both_hashes_and_nothing_loaded(tmp_path, caplog):
    """A checkpoint with a manifest beside it (as a run publishes it) is verified against its SHA-256 before the
    weights-only unpickler reads it: a flipped byte inside its tensors would load as Adam's moments. Without a
    manifest the zip CRCs catch the same byte, and the log says that no manifest vouched for it."""
    import logging

    from trainers.exit_codes import FatalError
    from trainers.format.checkpoints import CheckpointInfo, publish

    save = tmp_path / "save"
    save.mkdir()
    path, saved = _checkpoint(save, 8)
    info = publish(save, CheckpointInfo(path=path, tokens=64, batch=4, stage="s", stage_index=0))
    net = Net(8)
    opt = torch.optim.AdamW(net.parameters(), lr=5e-4)
    caplog.set_level(logging.INFO, logger="tessera.train")
    assert seed_optimizer(net, opt, path) == f"restored from {path}"
    assert f"train.init_optimizer_from: {path}: verified against its manifest tok-000000000064.json" in caplog.text

    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:  # a byte in the middle of the first tensor's stored bytes
        member = next(m for m in zf.infolist() if "/data/" in m.filename)
    with open(path, "rb") as f:  # the local header's own name and extra lengths (torch pads the extra field)
        f.seek(member.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    at = member.header_offset + 30 + name_len + extra_len + member.file_size // 2
    _flip(path, at)
    fresh = torch.optim.AdamW(net.parameters(), lr=5e-4)  # nothing in it yet
    with pytest.raises(FatalError) as refused:
        seed_optimizer(net, fresh, path)
    line = str(refused.value)
    assert line.startswith(f"train.init_optimizer_from: {path}: damaged checkpoint, not loaded: SHA-256 "), line
    assert line.endswith(f"is not the {info.sha256} published") and "\n" not in line
    assert fresh.state_dict()["state"] == {}

    (save / "manifests" / "tok-000000000064.json").unlink()
    caplog.clear()
    with pytest.raises(FatalError, match=r"damaged checkpoint, not loaded: CRC-32 mismatch in "):
        seed_optimizer(net, fresh, path)
    _flip(path, at)  # the byte back: the file loads, and the log says no manifest named it
    assert seed_optimizer(net, fresh, path) == f"restored from {path}"
    assert f"{path}: verified against its zip CRCs only: no manifest names it" in caplog.text
    assert [r.levelname for r in caplog.records if "zip CRCs" in r.getMessage()] == ["WARNING"]
