"""cuda-agent's kernel environment as an OpenEnv package: ``CudaAgentEnv`` is the client, ``KernelToolObservation``
the observation of a tool call (its ``feedback`` the evaluations the call ran)."""

from .client import CudaAgentEnv
from .models import CallToolAction, KernelObservation, KernelState, KernelToolObservation

__all__ = ["CallToolAction", "CudaAgentEnv", "KernelObservation", "KernelState", "KernelToolObservation"]
