"""The client: OpenEnv's MCP tool client for this environment.

    with CudaAgentEnv(base_url="http://localhost:8000").sync() as env:
        env.reset(task="cpu_swish")
        env.call_tool("bash", command="python utils/verify.py")       # the tool's text
        step = env.step(CallToolAction(tool_name="bash", arguments={"command": "python utils/profile.py"}))
        step.observation.metadata                                      # the turn's feedback rides in the payload
        print(env.step(CallToolAction(tool_name="finish")).reward)     # the closing evaluation's reward
"""

from cuda_agent.integrations.openenv import KernelToolEnvClient as CudaAgentEnv

__all__ = ["CudaAgentEnv"]
