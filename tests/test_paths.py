"""The environment of the sandboxed workers (``paths.worker_env``)."""

from cuda_agent.paths import worker_env


def test_workers_never_join_an_mps_server(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/var/run/nvidia-mps")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = worker_env(tmp_path)
    assert not [name for name in env if name.startswith("CUDA_MPS_")]
    assert env["CUDA_VISIBLE_DEVICES"] == "0"  # the rest of the environment is kept
    assert env["HOME"] == str(tmp_path)
