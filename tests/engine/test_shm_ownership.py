"""Shared-memory segments another local user made (review L5): never followed, never removed,
and a clear error instead of a PermissionError at every start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ketch.engine.worker import shm


def test_reclaim_skips_links_and_other_users_files(tmp_path: Path) -> None:
    victim = tmp_path / "victims-file"
    victim.write_bytes(b"x")
    link = tmp_path / "ketch-link"
    link.symlink_to(victim)
    foreign = tmp_path / "ketch-foreign"
    foreign.write_bytes(b"x")
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)
    mine = tmp_path / "ketch-mine"
    mine.write_bytes(b"x")
    removed = shm.reclaim_stale_segments(shm_dir=tmp_path)
    assert removed == ["ketch-mine"]
    assert link.is_symlink() and victim.exists() and foreign.exists() and not mine.exists()


def test_reclaim_does_not_fail_on_a_file_it_cannot_remove(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "ketch-stuck").write_bytes(b"x")

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    assert shm.reclaim_stale_segments(shm_dir=tmp_path) == ["ketch-stuck"]  # logged, no raise


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make another user's file")
def test_another_users_segment_is_a_clear_error(tmp_path: Path) -> None:
    foreign = tmp_path / "ketch-kv-9"
    foreign.write_bytes(b"x")
    os.chown(foreign, 65534, 65534)
    with pytest.raises(ValueError, match=r"owned by uid 65534.*run on other ports"):
        shm.remove_segment("ketch-kv-9", shm_dir=tmp_path)
    assert foreign.exists()


def test_a_linked_segment_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"x")
    (tmp_path / "ketch-kv-9").symlink_to(tmp_path / "target")
    with pytest.raises(ValueError, match="symbolic link"):
        shm.remove_segment("ketch-kv-9", shm_dir=tmp_path)
