"""Candidates: a ``ModelNew`` plus the C++/CUDA sources of the extension(s) it calls."""

from cuda_agent.candidates.candidate import (
    Candidate,
    CandidateError,
    Extension,
    check_candidate,
    check_extension,
    check_source_path,
    fixed_file,
    load_candidate,
    load_workspace,
)
from cuda_agent.candidates.inline import load_inline_file

__all__ = [
    "Candidate",
    "CandidateError",
    "Extension",
    "check_candidate",
    "check_extension",
    "check_source_path",
    "fixed_file",
    "load_candidate",
    "load_inline_file",
    "load_workspace",
]
