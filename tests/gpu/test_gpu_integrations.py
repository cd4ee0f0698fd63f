"""The RL stacks' own entry points on the GPU: one GRPO step of TRL's command line (``trl grpo --reward_funcs
cuda_agent.integrations.trl.kernel_reward``, the model on the GPU, rewards from the CUDA evaluator), one OpenEnv
episode through the OpenEnv package's server (``envs/cuda_agent_env``, MCP tools) whose evaluations run on the
evaluation service on the GPU; and, as before, a ``GRPOTrainer`` step with scripted completions and an episode
through ``serve``. The CPU versions are tests/integrations/test_trl.py and test_openenv.py.

Where the evaluator is ours, its policy asks a millionfold speedup before a correct candidate earns more than 1
(``NEVER_FASTER``), so the CUDA example's solution earns exactly 1 and prose -1 on any card; ``trl grpo`` makes its
own evaluators (the fair policy), so there the solution earns 1 to 3.

Run with ``bash benchmarks/gpu_session.sh integrations`` (carry ``.data`` and ``.whl``: trl, openenv and their
dependencies that the device machine lacks travel as wheels). The helpers below take the device and the example,
so a manual dry run can drive the same wiring on the CPU (``cpu``, ``examples/cpu_swish``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TESTS = Path(__file__).resolve().parents[1]
# tests/ (tiny_lm, scripted_policy) and tests/integrations (integration_setup), as their own tests import them.
sys.path[:0] = [p for p in (str(TESTS), str(TESTS / "integrations")) if p not in sys.path]
from integration_setup import CORRECT, INCORRECT, NEVER_FASTER, SANDBOX, console_script  # noqa: E402
from scripted_policy import COMMANDS, write_solution  # noqa: E402
from tiny_lm import save_replying_model, save_tiny_model, solution_reply, train_tokenizer  # noqa: E402

import cuda_agent  # noqa: E402
from cuda_agent.tasks import load_task  # noqa: E402

EXAMPLE = TESTS.parent / "examples" / "cuda_gelu"
PROSE = "I cannot write this kernel."


def needs(module: str, extra: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: pip install 'cuda-agent[{extra}]' (on the device "
                                       "machine: carry .whl, see benchmarks/gpu_session.sh)")


# -- TRL: one GRPO step, single-turn rewards from the evaluator ------------------------------------------------------


def grpo_step(example: Path, evaluator, where: Path, *, use_cpu: bool = False) -> tuple[dict[str, list], object]:
    """One real ``GRPOTrainer.train()`` step over ``example``'s task (as tests/integrations/test_trl.py, the model on
    the GPU unless ``use_cpu``): TRL's ``rollout_func`` replays two completions, the example's solution and prose;
    TRL decodes them and calls ``KernelReward`` with the dataset's columns. Returns what the reward saw and gave,
    and the trainer."""
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from cuda_agent.integrations.trl import KernelReward, tasks_to_dataset

    tokenizer = train_tokenizer()
    model_dir = save_tiny_model(where / "model", tokenizer, positions=4096)
    replies = [solution_reply(example / "solution"), PROSE]
    seen: dict[str, list] = {}

    def rollout(prompts, trainer):
        # Two completions per prompt (num_generations): the solution, then prose.
        prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                      for p in prompts]
        completion_ids = [tokenizer(replies[i % 2] + tokenizer.eos_token)["input_ids"] for i in range(len(prompts))]
        seen.setdefault("model_device", []).append(str(next(trainer.model.parameters()).device))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids]}

    reward = KernelReward(evaluator=evaluator, workers=2)

    def recorded(prompts, completions, **columns):
        started = time.monotonic()
        rewards = reward(prompts, completions, **columns)
        seen.setdefault("rewards", []).extend(rewards)
        seen.setdefault("names", []).extend(columns["name"])
        seen.setdefault("seconds", []).append(round(time.monotonic() - started, 1))
        return rewards

    recorded.__name__ = "kernel_reward"
    args = GRPOConfig(output_dir=str(where / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4096, max_steps=1, report_to="none", use_cpu=use_cpu, logging_steps=1,
                      save_strategy="no", bf16=False)
    trainer = GRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=recorded,
                          args=args, train_dataset=tasks_to_dataset(example / "model.py"), processing_class=tokenizer,
                          rollout_func=rollout)
    trainer.train()
    return seen, trainer


def test_grpo_step_with_the_model_on_the_gpu_is_rewarded_by_the_cuda_evaluator(tmp_path, cache_dir):
    needs("trl", "trl")
    needs("datasets", "trl")
    from cuda_agent.evaluate.evaluator import Evaluator

    task = load_task(EXAMPLE / "model.py")
    with Evaluator("cuda", policy=NEVER_FASTER, cache_dir=cache_dir, sandbox=SANDBOX, time_compile=False) as evaluator:
        seen, trainer = grpo_step(EXAMPLE, evaluator, tmp_path)
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    print(f"\nTRL GRPO step on {seen.get('model_device')}: rewards {seen.get('rewards')} for {seen.get('names')}, "
          f"evaluations {seen.get('seconds')} s; logged {logged}")
    assert seen["model_device"] and all(d.startswith("cuda") for d in seen["model_device"])
    assert sorted(seen["rewards"]) == [INCORRECT, CORRECT]
    assert set(seen["names"]) == {task.name}
    assert logged and logged[0]["reward"] == pytest.approx((CORRECT + INCORRECT) / 2)


def test_trl_grpo_command_step_on_the_gpu_is_rewarded_by_the_cuda_evaluator(tmp_path, cache_dir):
    """``trl grpo`` with our reward function by its dotted path, on the dataset ``cuda-agent export --format trl``
    wrote (reward settings: cuda, no compile baseline); the tiny model, fitted here to answer with the example's
    solution, trains on the GPU; both completions are evaluated by the CUDA evaluator in TRL's process."""
    needs("trl", "trl")
    needs("datasets", "trl")
    from cuda_agent.cli import main as cli
    from cuda_agent.train.single_turn import single_turn_messages

    task = load_task(EXAMPLE / "model.py")
    data = tmp_path / "data"
    assert cli(["export", str(EXAMPLE / "model.py"), "--format", "trl", "--out", str(data), "--device", "cuda",
                "--no-compile", "--sandbox", SANDBOX]) == 0
    model = save_replying_model(tmp_path / "model", single_turn_messages(task), solution_reply(EXAMPLE / "solution"))
    out = tmp_path / "out"
    src = str(Path(cuda_agent.__file__).resolve().parents[1])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_AGENT_REWARD_WORKERS="2",
               PYTHONPATH=os.pathsep.join(p for p in (src, str(TESTS), os.environ.get("PYTHONPATH")) if p))
    env.pop("CUDA_AGENT_SERVICE", None)
    # Wheels installed with --target leave the script off the path: console_script runs what it would.
    command = [*console_script("trl", "trl.cli.main:main"), "grpo", "--model_name_or_path", str(model),
               "--dataset_name", str(data), "--reward_funcs", "cuda_agent.integrations.trl.kernel_reward",
               "--output_dir", str(out),
               "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "4",
               "--max_steps", "1", "--report_to", "none", "--logging_steps", "1", "--save_strategy", "steps",
               "--save_steps", "1", "--bf16", "false", "--dtype", "float32"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    (logged,) = [entry for entry in state["log_history"] if "reward" in entry]
    print(f"\ntrl grpo on the GPU: {seconds:.1f} s; logged {logged}")
    assert logged["rewards/kernel_reward/mean"] is not None, done.stderr[-3000:]  # None: no verdict (the log says why)
    assert logged["rewards/kernel_reward/mean"] >= CORRECT and logged["rewards/kernel_reward/std"] == 0.0


# -- OpenEnv: one episode, the environment server's evaluations on the evaluation service -----------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


@contextmanager
def evaluation_service(device: str, cache_dir: Path) -> Iterator[str]:
    """The evaluation service (``cuda-agent serve``'s ``local_service`` and HTTP front, in this process: its policy
    is ``NEVER_FASTER``, which the command line cannot name) on a free port; yields its URL."""
    from cuda_agent.service import local_service, make_server

    service = local_service(device, policy=NEVER_FASTER, cache_dir=cache_dir, sandbox=SANDBOX, time_compile=False)
    try:
        server = make_server(service, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            host, port = server.server_address[:2]
            yield f"http://{host}:{port}"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=30)
    finally:
        service.close()


@contextmanager
def openenv_server(task_file: Path, service_url: str, log_path: Path) -> Iterator[str]:
    """``python -m cuda_agent.integrations.openenv serve --tasks TASK --service URL`` on a free port (the same
    ``cuda_agent`` this test imports); yields its URL once ``/health`` answers."""
    port = free_port()
    src = str(Path(cuda_agent.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "cuda_agent.integrations.openenv", "serve", "--tasks", str(task_file),
               "--service", service_url, "--sandbox", SANDBOX, "--port", str(port), "--max-sessions", "1",
               "--max-steps", "20"]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    get_json(url + "/health")
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"the OpenEnv server did not start (exit {proc.poll()}): "
                                             f"{log_path.read_text()[-4000:]}") from None
                    time.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def scripted_episode(server_url: str, example: Path) -> tuple[list, object, object]:
    """The scripted solved episode over OpenEnv's WebSocket client: write the example's solution, verify it,
    finish. Returns the tool steps' results, the closing step's result and the state after it."""
    from cuda_agent.integrations.openenv import FINISH, KernelAction, KernelEnvClient

    task = load_task(example / "model.py")
    calls = [*write_solution(example / "solution"), *COMMANDS[1]]  # python utils/verify.py
    with KernelEnvClient(base_url=server_url, message_timeout_s=600).sync() as env:
        opened = env.reset(task=task.name)
        assert not opened.done and opened.observation.task == task.name
        assert task.code in opened.observation.content
        steps = []
        for name, arguments in calls:
            result = env.step(KernelAction(tool=name, arguments=arguments))
            assert not result.done and not result.observation.error, result.observation.content
            steps.append(result)
        closed = env.step(KernelAction(tool=FINISH))
        state = env.state()
    return steps, closed, state


def test_openenv_episode_is_evaluated_by_the_service_on_the_gpu(tmp_path, cache_dir):
    needs("openenv", "openenv")
    needs("uvicorn", "openenv")
    needs("websockets", "openenv")
    with evaluation_service("cuda", cache_dir) as service:
        before = get_json(service + "/stats")
        assert before["device"] == "cuda" and before["counts"].get("done", 0) == 0
        with openenv_server(EXAMPLE / "model.py", service, tmp_path / "openenv.log") as server:
            started = time.monotonic()
            steps, closed, state = scripted_episode(server, EXAMPLE)
            seconds = time.monotonic() - started
        stats = get_json(service + "/stats")
    print(f"\nOpenEnv episode over the service on {stats['slots']}: {len(steps)} tool calls and finish in "
          f"{seconds:.1f} s, final {closed.observation.status} reward {closed.reward}; service counts {stats['counts']}")
    assert "correct" in steps[-1].observation.content.lower()  # verify's report
    assert closed.done and closed.observation.status == "correct"
    assert closed.reward == CORRECT
    assert state.done and state.reward == CORRECT and state.step_count == len(steps) + 1
    # verify and the closing evaluation ran on the service's GPU slot, and nothing there failed.
    assert stats["counts"].get("done", 0) >= 2, stats["counts"]
    assert not [k for k in stats["counts"] if k.startswith("failed")], stats["counts"]
    assert sum(slot["done"] for slot in stats["slots"]) >= 2 and all("gpu" in s["name"] for s in stats["slots"])


@contextmanager
def package_server(task_file: Path, service_url: str, log_path: Path) -> Iterator[str]:
    """The OpenEnv package's server as its Dockerfile runs it (``uvicorn server.app:app`` in envs/cuda_agent_env),
    configured as ``cuda-agent export --format openenv`` writes it: the task and the service in the environment."""
    port = free_port()
    package = TESTS.parent / "envs" / "cuda_agent_env"
    src = str(Path(cuda_agent.__file__).resolve().parents[1])
    env = dict(os.environ, CUDA_AGENT_TASKS=str(task_file), CUDA_AGENT_SERVICE=service_url,
               CUDA_AGENT_REWARD_SANDBOX=SANDBOX, CUDA_AGENT_MAX_SESSIONS="1", CUDA_AGENT_MAX_STEPS="20",
               PYTHONPATH=os.pathsep.join(p for p in (str(package), src, os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=package)
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    get_json(url + "/health")
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"the package's server did not start (exit {proc.poll()}): "
                                             f"{log_path.read_text()[-4000:]}") from None
                    time.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def test_openenv_package_episode_is_evaluated_by_the_service_on_the_gpu(tmp_path, cache_dir):
    """One episode through the OpenEnv package's server with OpenEnv's MCP tool client: write the solution, verify
    it (the observation's feedback: correct, with the speedups), finish (reward 1); the evaluations ran on the
    service's GPU slot."""
    needs("openenv", "openenv")
    needs("uvicorn", "openenv")
    needs("fastmcp", "openenv")
    from openenv.core.env_server.mcp_types import CallToolAction

    from cuda_agent.integrations.openenv import FINISH, KernelToolEnvClient

    task = load_task(EXAMPLE / "model.py")
    calls = [*write_solution(EXAMPLE / "solution"), *COMMANDS[1]]  # python utils/verify.py
    with evaluation_service("cuda", cache_dir) as service:
        with package_server(EXAMPLE / "model.py", service, tmp_path / "package.log") as server:
            metadata = get_json(server + "/metadata")
            started = time.monotonic()
            with KernelToolEnvClient(base_url=server).sync() as env:
                opened = env.reset(task=task.name)
                assert not opened.done and task.code in opened.observation.content
                for name, arguments in calls:
                    step = env.step(CallToolAction(tool_name=name, arguments=arguments))
                    assert not step.done and step.observation.error is None, step.observation
                closed = env.step(CallToolAction(tool_name=FINISH))
            seconds = time.monotonic() - started
        stats = get_json(service + "/stats")
    feedback = step.observation.feedback
    print(f"\nOpenEnv package episode over the service on {stats['slots']}: {len(calls)} tool calls and finish in "
          f"{seconds:.1f} s; verify's feedback {feedback}; final {closed.observation.status} reward {closed.reward}; "
          f"service counts {stats['counts']}")
    assert metadata["name"] == "cuda_agent_env" and metadata["readme_content"]
    assert [(f["command"], f["status"]) for f in feedback] == [("verify", "correct")]
    assert closed.done and closed.observation.status == "correct" and closed.reward == CORRECT
    assert stats["counts"].get("done", 0) >= 2, stats["counts"]
    assert not [k for k in stats["counts"] if k.startswith("failed")], stats["counts"]
