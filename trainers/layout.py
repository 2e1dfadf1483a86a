"""A run's save folder: what each file is called, and the one place that removes a checkpoint.

Layout of `save_folder` (names are scoped by run_name, so two runs can share a folder):
    <run>-s<K>-tok<T>-rank0.pt       Composer checkpoint of stage K after T tokens of the run (one rank, DDP)
    <run>-s<K>-tok<T>/               the same, sharded (trainers/sharding.py): __<rank>_0.distcp, .metadata
    latest-<run>-s<K>-rank0.pt       symlink Composer autoresume follows, per stage
    manifests/tok-<T>.json           done-marker (trainers/checkpoints.py), written after the .pt is complete
    <run>-stages.json                record of stage specs already trained on (trainers/trained_stages.py)
    <run>-rollbacks.json             loss-anomaly rollbacks (trainers/rollback.py)
    <run>-s<K>-tok<T>-rank0.pt.corrupt   the newest checkpoint withdrawn as damaged, kept for a look
With an s3:// train.save_folder the same names also live remotely (trainers/remote.py, whose
`retire` is the one place a remote checkpoint is removed).

Every local removal of a checkpoint goes through this module (deleting, through the format's
`store.remove`), in one of three ways: `discard` (a
file cut short by a kill, which never had a manifest), `retire` (keep-last-K rotation: manifest
first, so a watcher never reads a manifest whose file is gone) and `withdraw` (a damaged file:
manifest removed, file kept as `.corrupt`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainers.config import TrainJob
from trainers.format import checkpoints
from trainers.format.checkpoints import CheckpointInfo
from trainers.format.store import LocalCheckpoints, remove

log = logging.getLogger("tessera.layout")


def atomic_symlink(target: Path, link: Path) -> None:
    tmp = link.with_name(f".tmp-{link.name}")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)


def discard(path: Path) -> None:
    """Remove a checkpoint that never had a manifest (cut short by a kill, or downloaded incomplete)."""
    remove(path)


@dataclass(frozen=True)
class RunFolder:
    """One run's files in a local save folder."""

    path: Path
    run_name: str

    @classmethod
    def of(cls, job: TrainJob) -> RunFolder:
        return cls(Path(job.save_folder), job.run_name)

    # ------------------------------------------------------------ names

    def checkpoint_template(self, stage_index: int) -> str:
        """Composer filename template (it fills {token} and {rank})."""
        return f"{self.run_name}-s{stage_index}-tok{{token}}-rank{{rank}}.pt"

    def sharded_template(self, stage_index: int) -> str:
        """Composer's folder template for a sharded checkpoint (it fills {token})."""
        return f"{self.run_name}-s{stage_index}-tok{{token}}"

    def latest_template(self, stage_index: int) -> str:
        return f"latest-{self.run_name}-s{stage_index}-rank{{rank}}.pt"

    def latest_link(self, stage_index: int) -> Path:
        """Rank 0's latest symlink of a stage: the file Composer autoresume follows."""
        return self.path / self.latest_template(stage_index).format(rank=0)

    @property
    def stages_record(self) -> Path:
        return self.path / f"{self.run_name}-stages.json"

    @property
    def rollbacks(self) -> Path:
        return self.path / f"{self.run_name}-rollbacks.json"

    def owns(self, name: str) -> re.Match | None:
        """Whether a file name is one of this run's checkpoints (not another run's sharing the folder);
        the match's groups are the stage index and the token count."""
        return re.match(rf"^{re.escape(self.run_name)}-s(\d+)-tok(\d+)(?:-rank0\.pt)?$", name)

    # ------------------------------------------------------------ what is there

    def files(self) -> list[tuple[int, int, Path]]:
        """(stage_index, tokens, path) of this run's checkpoints on disk (files and sharded folders), published
        or not."""
        found = []
        for path in self.path.glob(f"{self.run_name}-s*-tok*"):
            match = self.owns(path.name)
            if match and (path.is_dir() == (not path.name.endswith(".pt"))):
                found.append((int(match[1]), int(match[2]), path))
        return sorted(found)

    def complete(self) -> list[CheckpointInfo]:
        """This run's published checkpoints, oldest first."""
        return [c for c in checkpoints.list_complete(self.path) if self.owns(Path(c.path).name)]

    def point_latest(self, stage_index: int, target: Path | None) -> None:
        """Re-point (or, with None, remove) the stage's latest symlink."""
        link = self.latest_link(stage_index)
        if target is None:
            link.unlink(missing_ok=True)
        else:
            atomic_symlink(target, link)

    # ------------------------------------------------------------ removal: the only place

    def set_aside(self, path: Path) -> None:
        """A complete file that no step of the curriculum explains: moved out of autoresume's way, kept."""
        aside = path.with_name(path.name + ".unpublished")
        remove(aside)
        os.replace(path, aside)
        log.warning(
            "checkpoint %s matches no step of this job's curriculum: set aside as %s.unpublished", path, path.name
        )

    def retire(self, info: CheckpointInfo) -> None:
        """Rotate a published checkpoint out: the manifest first, so a watcher never sees one whose file
        is gone mid-read (an evaluator pins what it reads: the store's pin)."""
        LocalCheckpoints(self.path).retire(info)

    def keep_last(self, keep: int | None) -> None:
        """Retire all but the newest `keep` published checkpoints of this run; None keeps all."""
        if keep is None:
            return
        for old in self.complete()[:-keep]:
            self.retire(old)

    def keep_newest_shards(self, keep: int | None) -> None:
        """On a node other than rank 0's, which holds no manifests: all but the newest `keep` sharded folders
        of this run go (their files are in the s3 mirror; rank 0's rotation is the one that counts)."""
        if keep is None:
            return
        folders = [path for _, _, path in sorted(self.files(), key=lambda f: f[1]) if path.is_dir()]
        for old in folders[:-keep]:
            remove(old)

    def withdraw(self, info: CheckpointInfo, why: str) -> None:
        """Neither autoresume nor an evaluator may pick it up again. The newest damaged file is kept as
        `<name>.corrupt` for a look; this run's older ones go, so they cannot pile up (another run
        sharing the folder keeps its own)."""
        log.warning("checkpoint %s is damaged (%s): withdrawn, the previous one is used", info.path, why)
        checkpoints.manifest_path(self.path, info.tokens).unlink(missing_ok=True)
        kept = Path(f"{info.path}.corrupt")
        for old in self.path.glob("*.corrupt"):
            if old != kept and self.owns(old.name.removesuffix(".corrupt")):
                remove(old)
        remove(kept)
        os.replace(info.path, kept)
