"""verifiers (verifiers 0.4) with the real library: the plugin resolved by its id through verifiers' own loaders,
one scripted episode run by verifiers' env (its rollout, its interception server between our loop and the model,
its scoring), the same reward as our loop; ``vf-eval`` itself on the config ``cuda-agent export`` writes, two
single-turn rollouts with their metrics; and the single-turn harness's one model call. The model is the local
OpenAI-protocol double replaying the scripted tool calls or reply; verifiers forwards each request to it.

verifiers 0.4 cannot be installed beside openenv 0.10 (mcp pins), so these tests run in CI's verl virtualenv and
skip in the main one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading

import pytest

vf = pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed: pip install 'cuda-agent[verifiers]' "
                                                "(not beside openenv: CI runs these in .ci/venv-verl)")

from openai_server import OpenAIServer  # noqa: E402
from scripted_policy import by_turn  # noqa: E402
from tiny_lm import solution_reply  # noqa: E402
from verifiers.v1.utils.loaders import load_environment, resolve_env_config  # noqa: E402

from cuda_agent.agent.session import SYSTEM_PROMPT  # noqa: E402
from cuda_agent.integrations.verifiers import (TASKSET_ID, KernelEnv, KernelHarness, KernelTask,  # noqa: E402
                                               KernelTaskset)
from cuda_agent.tasks import TaskError  # noqa: E402
from cuda_agent.train.single_turn import FAILURE_REWARD, single_turn_messages  # noqa: E402

from integration_setup import CORRECT, SANDBOX, console_script  # noqa: E402

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is missing: the episode's shell and candidates run in it")


def kernel_env(examples, **harness):
    """The env verifiers builds for ``vf-eval cuda-agent-kernels --env.taskset.tasks examples/cpu_swish``."""
    config = resolve_env_config({"taskset": {"id": TASKSET_ID, "tasks": str(examples / "cpu_swish")},
                                 "agent": {"harness": {"id": TASKSET_ID, **harness}}})
    return load_environment(config)


def test_the_id_resolves_to_our_taskset_harness_and_env(examples, task):
    env = kernel_env(examples)
    assert type(env) is KernelEnv and isinstance(env.taskset, KernelTaskset)
    assert env.config.agent.runtime.type == "subprocess"  # the harness runs in the worker: no sandbox to boot
    assert type(env._harnesses["agent"]) is KernelHarness  # the taskset's default harness, unnamed by the user
    (only,) = list(env.taskset)
    assert isinstance(only, KernelTask) and only.key == task.name and only.data.code == task.code
    empty = load_environment(resolve_env_config({"taskset": {"id": TASKSET_ID}}))
    with pytest.raises(TaskError, match="--env.taskset.tasks"):
        list(empty.taskset)
    assert not env._harnesses["agent"].config.single_turn  # the agentic episode unless asked
    # --env.agent.harness.single-turn, the harness left unnamed: it merges onto ours (not onto bash's).
    single = load_environment(resolve_env_config({"taskset": {"id": TASKSET_ID, "tasks": str(examples / "cpu_swish")},
                                                  "agent": {"harness": {"single_turn": True}}}))
    assert type(single._harnesses["agent"]) is KernelHarness and single._harnesses["agent"].config.single_turn


@pytest.mark.slow
@needs_bwrap
def test_episode_through_verifiers_earns_what_our_loop_earns(examples, task, evaluator, solved_calls, monkeypatch):
    """The scripted calls (write the solution, verify it), then a call to a tool that does not exist, then a reply
    without a tool call. The bad call changes no file, so the reward is still the loop's for the same calls."""
    monkeypatch.setattr(KernelHarness, "evaluator", evaluator)
    env = kernel_env(examples, sandbox=SANDBOX)
    (kernel_task,) = list(env.taskset)
    steps = [[call] for call in solved_calls] + [[("launch_missiles", {"target": "moon"})], "Verified."]

    async def one_episode(url: str):
        async with env.serving():
            ctx = vf.ModelContext(model="scripted", client=vf.EvalClientConfig(base_url=url))
            return await env.run_episode(kernel_task, ctx)

    # A closing evaluation without a verdict (the host too busy to time it: CI runs this file beside the fast tier)
    # is the adapter's honest outcome, not its failure: the episode runs once more, and only then must it be rewarded.
    for _ in range(2):
        with OpenAIServer(by_turn(steps)) as model:
            episode = asyncio.run(one_episode(model.url))
        (trace,) = episode.traces
        if not trace.state.no_verdict:
            break
    assert episode.ok, (episode.errors, trace.stop_condition, trace.state.reason,
                        [(e.type, e.message, e.traceback) for e in trace.errors])
    # The reward our loop earns for these calls is CORRECT (conftest's loop_episode asserts it, and the TRL and
    # OpenEnv tests compare with it); it is not run again in this environment, where this file would be its only user.
    assert trace.rewards["kernel_reward"].score == CORRECT
    assert trace.state.status == "correct" and trace.state.end_reason == "done"
    assert trace.metrics["correct"] == trace.metrics["fast_0"] == 1.0 and trace.metrics["no_verdict"] == 0.0
    assert trace.metrics["speedup_eager"] > 0 and trace.state.reason == "correct"
    # Every model call went through verifiers' interception to the model, with our tools offered.
    assert len(model.requests) == len(steps)
    assert {"bash", "write", "read"} <= {t["function"]["name"] for t in model.requests[0]["tools"]}
    messages = [node.message for node in trace.nodes]
    assert messages[0].content == SYSTEM_PROMPT and task.code in messages[1].content
    results = [m.content for m in messages if m.role == "tool"]
    assert len(results) == len(solved_calls) + 1
    assert "status: correct" in results[-2]  # verify's report
    assert "unknown tool 'launch_missiles'" in results[-1] and "bash" in results[-1]


def single_turn_episode(env, reply: str):
    """One rollout of ``env`` with the model answering ``reply``; the episode and the model's requests."""
    (kernel_task,) = list(env.taskset)

    async def one_episode(url: str):
        async with env.serving():
            ctx = vf.ModelContext(model="scripted", client=vf.EvalClientConfig(base_url=url))
            return await env.run_episode(kernel_task, ctx)

    with OpenAIServer(lambda request: reply) as model:
        episode = asyncio.run(one_episode(model.url))
    assert episode.ok, episode.errors
    return episode, model.requests


@pytest.mark.slow
@needs_bwrap
def test_vf_eval_command_scores_single_turn_rollouts_with_metrics(examples, tmp_path):
    """verifiers' own command line on the config ``cuda-agent export --format verifiers`` wrote: ``vf-eval @
    vf-eval.toml`` against the OpenAI-protocol double, two rollouts of the single-turn harness, the double answering
    the example's solution to one and prose to the other. Each rollout has every metric and the reason it earned
    what it did; the solution's is evaluated by the real CPU evaluator in vf-eval's process."""
    from cuda_agent.cli import main as cli

    data = tmp_path / "data"
    assert cli(["export", str(examples / "cpu_swish"), "--format", "verifiers", "--out", str(data), "--device", "cpu",
                "--no-compile", "--sandbox", SANDBOX]) == 0
    replies = iter([solution_reply(examples / "cpu_swish" / "solution"), "I cannot write this kernel."])
    lock = threading.Lock()

    def answer(request):
        with lock:
            return next(replies)

    def vf_eval(runs):
        with OpenAIServer(answer) as model:
            command = [*console_script("vf-eval", "verifiers.v1.cli.eval.main:main"), "@", str(data / "vf-eval.toml"),
                       "-m", "scripted", "--client.base-url", model.url, "-r", "2", "-c", "1", "--no-push",
                       "-o", str(runs)]
            env = {k: v for k, v in os.environ.items() if k != "CUDA_AGENT_SERVICE"}
            done = subprocess.run(command, cwd=tmp_path, env=env | {"OPENAI_API_KEY": "unused"}, capture_output=True,
                                  text=True, timeout=900)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        (traces,) = list(runs.rglob("traces.jsonl"))
        found = [trace for line in traces.read_text().splitlines() if line.strip()
                 for trace in json.loads(line)["traces"]]
        assert len(found) == 2 and len(model.requests) == 2
        return found

    traces_ = vf_eval(tmp_path / "runs")
    # A no-verdict (the host too busy to time the solution: CI runs this file beside the fast tier) is an honest
    # outcome, not the adapter's failure: the two rollouts run once more, and only then must they be judged.
    if any(t["info"].get("cuda_agent", {}).get("no_verdict") for t in traces_):
        replies = iter([solution_reply(examples / "cpu_swish" / "solution"), "I cannot write this kernel."])
        traces_ = vf_eval(tmp_path / "runs-again")
    # The outcome rides on each trace's info (verifiers does not save the state); a no-verdict (a busy host) would
    # be a harness error with its reason.
    by_status = {t["info"].get("cuda_agent", {}).get("status"): t for t in traces_}
    assert set(by_status) == {"correct", "no candidate"}, [(t["info"], t["errors"]) for t in traces_]
    solved, prose = by_status["correct"], by_status["no candidate"]
    expected = {"correct", "fast_0", "fast_1", "fast_2", "speedup_eager", "speedup_compile", "beats_eager",
                "beats_compile", "no_verdict"}
    assert set(solved["metrics"]) == set(prose["metrics"]) == expected
    assert solved["metrics"]["correct"] == solved["metrics"]["fast_0"] == 1.0 and solved["metrics"]["speedup_eager"] > 0
    assert solved["rewards"]["kernel_reward"]["score"] >= CORRECT
    assert solved["info"]["cuda_agent"]["reason"] == "correct"
    assert prose["metrics"]["correct"] == 0.0 and prose["rewards"]["kernel_reward"]["score"] == FAILURE_REWARD
    assert "model_new.py" in prose["info"]["cuda_agent"]["reason"]


def test_single_turn_makes_one_model_call_with_the_single_turn_prompt(examples, task, evaluator, monkeypatch):
    """``--env.agent.harness.single-turn``: one model call through verifiers' interception, the single-turn prompt
    without tools; a reply without code earns the failure reward without an evaluation, with the reason and the
    metrics on the trace. (The solution's reply, evaluated, is the ``vf-eval`` command's test above.)"""
    monkeypatch.setattr(KernelHarness, "evaluator", evaluator)
    env = kernel_env(examples, sandbox=SANDBOX, single_turn=True)
    prose, requests = single_turn_episode(env, "I cannot write this kernel.")
    (trace,) = prose.traces
    assert trace.rewards["kernel_reward"].score == FAILURE_REWARD and trace.state.status == "no candidate"
    assert trace.metrics["correct"] == 0.0 and "model_new.py" in trace.info["cuda_agent"]["reason"]
    (request,) = requests  # one model call, through the interception
    assert not request.get("tools")
    assert [{"role": m["role"], "content": m["content"]} for m in request["messages"]] == single_turn_messages(task)
    assert [node.message.content for node in trace.nodes][-1] == "I cannot write this kernel."
