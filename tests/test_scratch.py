"""The scratch record a Ctrl-C'd command removes on its way out (``cuda_agent.scratch``)."""

import shutil

from cuda_agent import scratch


def test_a_folder_written_into_while_it_is_removed_is_removed_again(tmp_path, monkeypatch):
    """A thread (or a process not yet taken down) that adds a file as the tree is removed leaves its top folder not
    empty: ``remove_all`` removes it again."""
    folder = scratch.made(tmp_path / "cuda-agent-synth-x")
    folder.mkdir()
    (folder / "a").write_text("x")
    real = shutil.rmtree
    calls = []

    def late_write(path, ignore_errors=False):
        real(path, ignore_errors=ignore_errors)
        calls.append(path)
        if len(calls) == 1:  # the writer's file lands just after the first removal
            path.mkdir()
            (path / "late").write_text("x")

    monkeypatch.setattr(scratch.shutil, "rmtree", late_write)
    assert scratch.remove_all() == [folder]
    assert not folder.exists() and len(calls) == 2
