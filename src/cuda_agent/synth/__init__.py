"""Data synthesis: operator catalog -> fused tasks -> execution filters -> decontaminated dataset.

So far: ``decontaminate``, the structural AST similarity used to decontaminate
synthesised tasks against KernelBench.
"""

from cuda_agent.synth.decontaminate import Decontaminator, Match, similarity, structure_tokens

__all__ = ["Decontaminator", "Match", "similarity", "structure_tokens"]
