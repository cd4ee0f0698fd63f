"""The red-team case folders are well formed: each says what it games and what the evaluator must answer, and holds
only files a candidate has. Fast (no evaluation): a malformed folder fails here, not minutes into the slow suite."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
from casekit import CASES_DIR, FRACTIONS, GPU_CASES_DIR, PIECES, SUITES, TAIL_DEFINE, load_cases, make_candidate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KEYS = {"pattern", "suite", "games", "runtime", "task", "expect", "policy", "timing", "fractions", "headers", "python"}


class CaseDir(NamedTuple):
    """A case directory: the example solution its cases' files replace, the binding a deferral case sets its
    fraction in, and how many deferral mechanisms it holds."""

    cases: Path
    solution: Path
    binding: str
    mechanisms: int

    def folders(self) -> list[Path]:
        return sorted(p for p in self.cases.iterdir() if p.is_dir())


DIRECTORIES = [
    pytest.param(CaseDir(CASES_DIR, EXAMPLES / "cpu_swish" / "solution", "scaled_swish_binding.cpp", 4), id="cpu"),
    pytest.param(CaseDir(GPU_CASES_DIR, EXAMPLES / "cuda_gelu" / "solution", "gelu_binding.cpp", 9), id="gpu"),
]


@pytest.mark.parametrize("where", DIRECTORIES)
def test_every_case_folder_says_what_it_games_and_what_is_expected(where):
    problems = []
    for folder in where.folders():
        if not (folder / "case.toml").is_file():
            problems.append(f"{folder.name}: no case.toml")
            continue
        spec = tomllib.loads((folder / "case.toml").read_text())
        if set(spec) - KEYS:
            problems.append(f"{folder.name}: unknown keys {sorted(set(spec) - KEYS)}")
        if "python" in spec and not all(part.isdigit() for part in str(spec["python"]).split(".")):
            problems.append(f"{folder.name}: python is a version such as \"3.12\"")
        if spec.get("suite") not in SUITES or not spec.get("pattern") or not spec.get("games", "").strip():
            problems.append(f"{folder.name}: needs a suite of {sorted(SUITES)}, a pattern and what it games")
        expect = spec.get("expect", {})
        if spec.get("suite") == "rejected" and (expect.get("status") not in ("failed", "incorrect")
                                                or expect.get("reward") != -1.0):
            problems.append(f"{folder.name}: a rejected case expects failed or incorrect, reward -1")
        if spec.get("suite") in ("true-cost", "deferral") and not expect.get("gains_nothing"):
            problems.append(f"{folder.name}: expect.gains_nothing")
        if "task" in spec and not (folder / spec["task"]).is_file():
            problems.append(f"{folder.name}: its task {spec['task']} is missing")
        for header, pieces in spec.get("headers", {}).items():
            missing = [name for name in pieces if not (PIECES / name).is_file()]
            if missing or not header.endswith(".h") or (folder / header).exists():
                problems.append(f"{folder.name}: header {header} must be a new .h written from pieces/ "
                                f"(missing pieces: {missing})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("where", DIRECTORIES)
def test_a_case_holds_the_files_of_a_candidate_and_nothing_else(where):
    """model_new.py always; otherwise only files of the example's solution, which the case's replace."""
    problems = []
    for folder in where.folders():
        files = {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()} - {Path("case.toml"), Path("task.py")}
        if Path("model_new.py") not in files:
            problems.append(f"{folder.name}: no model_new.py")
        strangers = sorted(str(f) for f in files if not (where.solution / f).is_file())
        if strangers:
            problems.append(f"{folder.name}: {strangers} replace no file of {where.solution}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("where", DIRECTORIES)
def test_each_deferral_mechanism_has_a_case_for_every_fraction(where):
    """One folder a mechanism; its ``fractions`` name every fraction, and its binding has the one
    ``#define TAIL_DENOMINATOR`` line each case sets."""
    found = {}
    for folder in where.folders():
        spec = tomllib.loads((folder / "case.toml").read_text())
        if spec["suite"] == "deferral":
            found[folder.name] = sorted(spec.get("fractions", []))
            text = (folder / "kernels" / where.binding).read_text()
            assert len(TAIL_DEFINE.findall(text)) == 1, f"{folder.name}: one #define TAIL_DENOMINATOR line"
    assert len(found) == where.mechanisms and all(f == sorted(FRACTIONS) for f in found.values()), found


@pytest.mark.parametrize("where", DIRECTORIES)
def test_every_case_makes_a_candidate_whose_headers_are_included(where, tmp_path):
    """Each case (each fraction of a deferral folder) as the suites make it: the example's files replaced, its headers
    written from the pieces, each included by a source beside it, and its fraction set."""
    problems = []
    for case in (case for suite in SUITES for case in load_cases(where.cases, suite)):
        root = tmp_path / case.name
        make_candidate(case, where.solution, root)
        for header in case.headers:
            sources = [p.read_text() for p in (root / header).parent.glob("*.c*")]
            if not any(f'#include "{Path(header).name}"' in text for text in sources):
                problems.append(f"{case.name}: nothing beside {header} includes it")
        if case.tail_denominator is not None:
            text = (root / "kernels" / where.binding).read_text()
            if f"#define TAIL_DENOMINATOR {case.tail_denominator}\n" not in text:
                problems.append(f"{case.name}: its binding does not set TAIL_DENOMINATOR to {case.tail_denominator}")
    assert not problems, "\n".join(problems)
