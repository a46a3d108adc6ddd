"""Loading models: the default target's cache, made once, safely under concurrent first loads."""

from __future__ import annotations

import pytest


def test_a_cache_folder_published_by_another_process_first_is_kept(tmp_path):
    """Two first loads of the default model at once: the second rename finds the folder made
    and keeps it (it said `OSError: Directory not empty` before)."""
    from specdec.decoders.models.loading import publish_directory

    target = tmp_path / "models" / "m"
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    for folder in (theirs, ours):
        folder.mkdir()
        (folder / "model.safetensors").write_text(folder.name)
    publish_directory(theirs, target, "model.safetensors")
    publish_directory(ours, target, "model.safetensors")
    assert (target / "model.safetensors").read_text() == "theirs" and not ours.exists()
    half = tmp_path / "half"
    half.mkdir()
    (half / "other").write_text("x")
    broken = tmp_path / "models" / "broken"
    broken.mkdir()
    (broken / "partial").write_text("x")  # there, but not a finished cache: still an error
    with pytest.raises(OSError):
        publish_directory(half, broken, "model.safetensors")
