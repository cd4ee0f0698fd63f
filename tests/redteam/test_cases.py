"""The red-team case folders are well formed: each says what it games and what the evaluator must answer, and holds
only files a candidate has. Fast (no evaluation): a malformed folder fails here, not minutes into the slow suite."""

from __future__ import annotations

import tomllib
from pathlib import Path

from casekit import FRACTIONS, TAIL_DEFINE

CASES_DIR = Path(__file__).parent / "cases"
SOLUTION = Path(__file__).resolve().parents[2] / "examples" / "cpu_swish" / "solution"
KEYS = {"pattern", "suite", "games", "runtime", "task", "expect", "policy", "fractions", "headers"}
PIECES = Path(__file__).parent / "pieces"
SUITES = {"rejected", "true-cost", "deferral", "honest"}


def folders() -> list[Path]:
    return sorted(p for p in CASES_DIR.iterdir() if p.is_dir())


def test_every_case_folder_says_what_it_games_and_what_is_expected():
    problems = []
    for folder in folders():
        if not (folder / "case.toml").is_file():
            problems.append(f"{folder.name}: no case.toml")
            continue
        spec = tomllib.loads((folder / "case.toml").read_text())
        if set(spec) - KEYS:
            problems.append(f"{folder.name}: unknown keys {sorted(set(spec) - KEYS)}")
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


def test_a_case_holds_the_files_of_a_candidate_and_nothing_else():
    """model_new.py always; otherwise only files of the example's solution, which the case's replace."""
    problems = []
    for folder in folders():
        files = {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()} - {Path("case.toml"), Path("task.py")}
        if Path("model_new.py") not in files:
            problems.append(f"{folder.name}: no model_new.py")
        strangers = sorted(str(f) for f in files if not (SOLUTION / f).is_file())
        if strangers:
            problems.append(f"{folder.name}: {strangers} replace no file of {SOLUTION}")
    assert not problems, "\n".join(problems)


def test_each_deferral_mechanism_has_a_case_for_every_fraction():
    """Four mechanisms, one folder each; its ``fractions`` name every fraction, and its binding has the one
    ``#define TAIL_DENOMINATOR`` line each case sets."""
    mechanisms = {}
    for folder in folders():
        spec = tomllib.loads((folder / "case.toml").read_text())
        if spec["suite"] == "deferral":
            mechanisms[folder.name] = sorted(spec.get("fractions", []))
            binding = (folder / "kernels" / "scaled_swish_binding.cpp").read_text()
            assert len(TAIL_DEFINE.findall(binding)) == 1, f"{folder.name}: one #define TAIL_DENOMINATOR line"
    assert len(mechanisms) == 4 and all(f == sorted(FRACTIONS) for f in mechanisms.values()), mechanisms
