"""The OpenEnv server of the kernel environment: OpenEnv's FastAPI app (``/reset``, ``/step``, ``/state``,
``/schema``, ``/health``, ``/metadata``, ``/ws``, ``/mcp``) over ``KernelToolEnv``, one environment per session.

Configured from the environment (``cuda-agent export --format openenv`` writes these for ``--env-file``):

    CUDA_AGENT_TASKS            the task source (default: the repository's examples/)
    CUDA_AGENT_SERVICE          the evaluation service's URL (default: evaluators in this process)
    CUDA_AGENT_REWARD_DEVICE    auto | cpu | cuda; CUDA_AGENT_REWARD_POLICY fair | strict | paper;
    CUDA_AGENT_REWARD_SANDBOX   auto | bwrap | none; CUDA_AGENT_REWARD_TIME_COMPILE 1 | 0
    CUDA_AGENT_MAX_SESSIONS     sessions at once (8); CUDA_AGENT_MAX_STEPS tool calls an episode (150)

Run: ``uvicorn server.app:app --host 0.0.0.0 --port 8000`` in this folder, or ``python -m server.app``.
"""

from pathlib import Path

from cuda_agent.integrations.openenv import make_package_app

app = make_package_app(readme=str(Path(__file__).resolve().parents[1] / "README.md"))


def main() -> None:
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description="Serve the kernel environment over OpenEnv's protocol.")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
