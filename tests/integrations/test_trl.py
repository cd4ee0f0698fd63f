"""TRL (trl's GRPOTrainer) with the real library: the single-turn kernel reward inside a real GRPO step, and the
agentic episode as TRL's environment (environment_factory), driven the way the trainer drives it."""

from __future__ import annotations

import inspect
import json

import pytest

trl = pytest.importorskip("trl", reason="trl is not installed: pip install 'cuda-agent[trl]' to run the TRL tests")

from tiny_lm import save_tiny_model, solution_reply, train_tokenizer  # noqa: E402

from cuda_agent.integrations.trl import KernelEnvironment, KernelReward, tasks_to_dataset  # noqa: E402
from cuda_agent.train.single_turn import single_turn_messages  # noqa: E402

from integration_setup import CORRECT, INCORRECT, SANDBOX  # noqa: E402


def test_dataset_holds_prompts_and_tasks_from_a_folder_of_task_files(examples, task):
    data = tasks_to_dataset(examples / "cpu_swish")
    (row,) = [r for r in data if r["name"] == task.name]
    assert row["prompt"] == single_turn_messages(task) and row["code"] == task.code
    multi = tasks_to_dataset(examples / "cpu_swish", multi_turn=True)
    assert [m["role"] for m in multi[0]["prompt"]] == ["system", "user"]


@pytest.mark.slow
def test_grpo_step_is_rewarded_by_the_evaluator(tmp_path, examples, task, evaluator):
    """One real GRPOTrainer step. Generation is TRL's ``rollout_func`` replaying scripted completions (a random tiny
    model writes no kernels): one completion is the example's solution, one is prose; TRL decodes them and calls
    our reward with the dataset's columns."""
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = train_tokenizer()
    model_dir = save_tiny_model(tmp_path / "model", tokenizer, positions=4096)
    replies = [solution_reply(examples / "cpu_swish" / "solution"), "I cannot write this kernel."]
    seen: dict[str, list] = {}

    def rollout(prompts, trainer):
        # Two completions per prompt (num_generations): the solution, then prose.
        prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                      for p in prompts]
        completion_ids = [tokenizer(replies[i % 2] + tokenizer.eos_token)["input_ids"] for i in range(len(prompts))]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids]}

    reward = KernelReward(evaluator=evaluator, workers=2)

    def recorded(prompts, completions, **columns):
        rewards = reward(prompts, completions, **columns)
        seen.setdefault("rewards", []).extend(rewards)
        seen.setdefault("names", []).extend(columns["name"])
        return rewards

    recorded.__name__ = "kernel_reward"
    dataset = tasks_to_dataset(examples / "cpu_swish")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4096, max_steps=1, report_to="none", use_cpu=True, logging_steps=1,
                      save_strategy="no", bf16=False)
    trainer = GRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=recorded,
                          args=args, train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout)
    trainer.train()
    assert sorted(seen["rewards"]) == [INCORRECT, CORRECT]
    assert set(seen["names"]) == {task.name}
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged and logged[0]["reward"] == pytest.approx((CORRECT + INCORRECT) / 2)


def trl_tool_dict(environment) -> dict:
    """The tools TRL exposes for an environment instance (GRPOTrainer._generate_and_score_completions, trl 1.16)."""
    return {name: getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")}


@pytest.mark.slow
def test_environment_episode_earns_what_our_loop_earns(examples, task, evaluator, solved_calls, loop_episode):
    """The same tool calls through the environment, called as TRL calls it: ``reset(**row)``, each tool by name with
    the parsed arguments, ``get_reward()``; then the instance is reset for the next rollout (TRL pools them)."""
    from transformers.utils import get_json_schema

    environment = KernelEnvironment.factory(evaluator=evaluator, sandbox=SANDBOX)()
    tools = trl_tool_dict(environment)
    # TRL renders each tool's schema from its signature and docstring; ours must survive that.
    schemas = {name: get_json_schema(tool)["function"] for name, tool in tools.items()}
    assert {"bash", "read", "write", "edit"} <= set(schemas)
    assert schemas["write"]["parameters"]["required"] == ["path", "content"]
    row = tasks_to_dataset(examples / "cpu_swish", multi_turn=True)[0]
    opening = environment.reset(**row)
    assert task.code in opening and "SKILL" in opening or "utils/verify.py" in opening
    outputs = [tools[name](**arguments) for name, arguments in solved_calls]
    assert "correct" in outputs[-1].lower()  # verify's report
    assert environment.get_reward() == loop_episode.reward == CORRECT
    # The pooled instance, reset for the next rollout: a fresh workspace with the stub ModelNew (its -1 is the
    # trainer test's below; here it would cost one more evaluation).
    environment.reset(**row)
    assert "scaled_swish" not in tools["read"](path="model_new.py")
    assert "error" in json.dumps(tools["read"](path="no_such_file.py")).lower()
    environment._close()


@pytest.mark.slow
def test_a_grpo_step_runs_episodes_in_the_environment(tmp_path, examples, evaluator):
    """A real GRPOTrainer step with ``environment_factory``: TRL probes an instance, renders our tools into the
    prompt, resets one instance per rollout with its row and scores it with ``get_reward``. The random tiny model
    calls no tool, so each episode ends with the stub ModelNew: -1 (the scripted episode is the test above)."""
    from pathlib import Path

    import transformers
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = train_tokenizer()
    # A chat template TRL knows how to parse tool calls from (its Qwen2.5 one: <tool_call> JSON </tool_call>).
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    model_dir = save_tiny_model(tmp_path / "model", tokenizer)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=8, max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                      logging_steps=1)
    factory = KernelEnvironment.factory(evaluator=evaluator, sandbox=SANDBOX)
    trainer = GRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                          train_dataset=tasks_to_dataset(examples / "cpu_swish", multi_turn=True),
                          processing_class=tokenizer, environment_factory=factory)
    assert "KernelEnvironment" in trainer.reward_func_names
    assert {t.__name__ for t in trainer.tools} >= {"bash", "read", "write", "edit"}
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged and logged[0]["reward"] == INCORRECT
    environments = trainer._environment_pool[None]
    assert all(env.episode is not None and env.episode.outcome is not None for env in environments)
