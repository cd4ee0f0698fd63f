"""Data synthesis: operator catalog -> fused tasks -> execution filters -> decontaminated dataset.

``catalog`` crawls the installed torch (and transformers) into operator entries;
``compose`` (programmatic) and ``llm`` (an OpenAI-compatible model) turn samples
of them into KernelBench programs; ``pipeline`` screens them with the execution
filters in sandboxed processes and appends the accepted ones; ``report`` writes
parquet, the dataset card and the report. ``decontaminate`` is the structural
similarity used against KernelBench and inside the set.
"""

from cuda_agent.synth.catalog import Catalog, Operator, build_catalog, default_catalog
from cuda_agent.synth.compose import Program, ProgramComposer, SizeProfile
from cuda_agent.synth.decontaminate import Decontaminator, Match, similarity, structure_tokens
from cuda_agent.synth.pipeline import FILTERS, SynthConfig, Synthesis, synthesize

__all__ = [
    "FILTERS", "Catalog", "Decontaminator", "Match", "Operator", "Program", "ProgramComposer", "SizeProfile",
    "SynthConfig", "Synthesis", "build_catalog", "default_catalog", "similarity", "structure_tokens", "synthesize",
]
