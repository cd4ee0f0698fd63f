"""The environment's wire types: OpenEnv's ``CallToolAction`` (a tool by name, with its arguments), the reset
observation (``KernelObservation``: the opening messages and the tools' schemas), a tool call's observation
(``KernelToolObservation``: the result, the turn's feedback, and at the end the reward) and the state."""

from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

from cuda_agent.integrations.openenv import KernelObservation, KernelState, KernelToolObservation

__all__ = ["CallToolAction", "KernelObservation", "KernelState", "KernelToolObservation", "ListToolsAction"]
