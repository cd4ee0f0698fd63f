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


SECRETS = {"OPENAI_API_KEY": "sk-planted-openai", "HF_TOKEN": "hf_planted", "AWS_SECRET_ACCESS_KEY": "planted-aws",
           "MY_SECRET_TOKEN": "planted-custom", "CUDA_AGENT_SERVICE_TOKEN": "planted-service",
           "WANDB_API_KEY": "planted-wandb", "OPENAI_BASE_URL": "http://planted.example"}


def test_only_allowlisted_variables_reach_workers_and_compilers(monkeypatch, tmp_path):
    from cuda_agent.paths import PASSED_ENV, compiler_env, passed_env

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("LC_NUMERIC", "C")
    for env in (worker_env(tmp_path), compiler_env(), passed_env()):
        assert not set(SECRETS) & set(env)
        assert not set(SECRETS.values()) & set(env.values())
        assert env["OMP_NUM_THREADS"] == "3" and env["LC_NUMERIC"] == "C"
        assert all(name in PASSED_ENV or name.startswith("LC_") or name in worker_env(tmp_path)
                   for name in env)
    assert compiler_env()["HOME"] == "/tmp"
