"""The kernel environment's verifiers plugin, id ``cuda-agent-kernels`` (``vf-eval cuda-agent-kernels ...``).

verifiers 0.4 resolves a taskset id by importing it as a top-level module (``-`` as ``_``) and taking the
``Taskset``, ``Harness`` and ``Env`` subclasses its ``__all__`` exports; a dotted id does not resolve. So this
package only names the adapter, ``cuda_agent.integrations.verifiers``, where everything is defined.
"""

from cuda_agent.integrations.verifiers import KernelEnv, KernelHarness, KernelTaskset

__all__ = ["KernelEnv", "KernelHarness", "KernelTaskset"]
