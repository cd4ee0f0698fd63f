"""What the red-team suites share: a case as a folder (``FolderCase``: the candidate's files and a ``case.toml``,
``cases/README.md`` describes one), the candidate made from it over an example's solution, the C++ and Python pieces
several cases share (files in ``pieces/``, written into a case's headers), and the bar a case that moves its work
where its own clock cannot see it must meet (``gains_nothing``).

The CPU cases (``cases/``) replace files of the CPU example's solution, the GPU cases (``gpu_cases/``) those of the
CUDA example's."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from cuda_agent import load_candidate

HERE = Path(__file__).parent
PIECES = HERE / "pieces"
CASES_DIR = HERE / "cases"
GPU_CASES_DIR = HERE / "gpu_cases"
SUITES = ("rejected", "true-cost", "deferral", "honest", "own-test")
NOT_CANDIDATE_FILES = ("case.toml", "task.py")  # what a case folder holds beside the candidate's own files
# The fractions of each timed call's work a deferral case leaves for after its region (``-1of<d>``).
FRACTIONS = (2, 4, 8, 16)
# The line of a deferral case's binding that sets its fraction (a case folder holds it once, set per case).
TAIL_DEFINE = re.compile(r"^#define TAIL_DENOMINATOR \d+$", re.M)


def piece(name: str) -> str:
    """The text of one piece (``pieces/``), C++ or Python, as the cases splice it into a candidate."""
    return (PIECES / name).read_text()


@dataclass(frozen=True)
class FolderCase:
    """One case folder: the candidate's files, the task, and what the evaluator must answer."""

    name: str
    folder: Path
    pattern: str  # the row of docs/SECURITY.md
    suite: str
    games: str
    runtime: bool = False  # static checks off
    task: str | None = None  # task source; default: the example
    policy: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)  # TimingConfig's fields, changed for this case
    expect: dict = field(default_factory=dict)
    tail_denominator: int | None = None  # a deferral case: the d of its binding's ``#define TAIL_DENOMINATOR d``
    headers: dict = field(default_factory=dict)  # candidate path -> the pieces (``pieces/``) joined into it
    python: tuple[int, int] | None = None  # the least Python the case runs on

    @property
    def status(self) -> str:
        return self.expect["status"]

    @property
    def rule(self) -> str | None:
        return self.expect.get("rule")

    @property
    def reason(self) -> str | None:
        """A substring of the reason, where the rule alone is not specific."""
        return self.expect.get("reason")

    @property
    def runs_here(self) -> bool:
        return self.python is None or sys.version_info[:2] >= self.python


def cases_of(folder: Path) -> list[FolderCase]:
    """The folder's case, or, where its ``case.toml`` lists ``fractions``, one case for each (``...-1of<d>-runtime``)."""
    spec = tomllib.loads((folder / "case.toml").read_text())
    task = folder / spec["task"] if "task" in spec else None
    # TOML has arrays, the policy tuples.
    policy = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.get("policy", {}).items()}
    python = tuple(int(part) for part in spec["python"].split(".")) if "python" in spec else None
    case = FolderCase(name=folder.name, folder=folder, pattern=spec["pattern"], suite=spec["suite"], games=spec["games"],
                      runtime=spec.get("runtime", False), task=task.read_text() if task else None, policy=policy,
                      timing=spec.get("timing", {}), expect=spec.get("expect", {}), headers=spec.get("headers", {}),
                      python=python)
    if "fractions" not in spec:
        return [case]
    stem = folder.name.removesuffix("-runtime")
    return [replace(case, name=f"{stem}-1of{d}" + ("-runtime" if stem != folder.name else ""), tail_denominator=d)
            for d in spec["fractions"]]


def load_case(folder: Path) -> FolderCase:
    """The one case of a folder without ``fractions``."""
    (case,) = cases_of(folder)
    return case


def load_cases(cases_dir: Path, suite: str, fractions: tuple[int, ...] = FRACTIONS) -> list[FolderCase]:
    """The cases of ``cases_dir`` in ``suite``; of a deferral folder, those of ``fractions``."""
    cases = [case for folder in sorted(cases_dir.iterdir()) if (folder / "case.toml").is_file()
             for case in cases_of(folder)]
    chosen = [case for case in cases if case.suite == suite]
    return [case for case in chosen if case.tail_denominator is None or case.tail_denominator in fractions]


def make_candidate(case: FolderCase, solution: Path, root: Path):
    """The example's ``solution`` with the case's files in place of its own, and its headers written from pieces."""
    shutil.copytree(solution, root)
    for path in sorted(case.folder.rglob("*")):
        if path.is_file() and path.name not in NOT_CANDIDATE_FILES:
            target = root / path.relative_to(case.folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            text = path.read_bytes()
            if case.tail_denominator is not None and path.suffix == ".cpp":
                source, found = TAIL_DEFINE.subn(f"#define TAIL_DENOMINATOR {case.tail_denominator}", text.decode())
                assert found == 1, f"{path}: one #define TAIL_DENOMINATOR line to set, found {found}"
                text = source.encode()
            target.write_bytes(text)
    for path, pieces in case.headers.items():
        (root / path).write_text("#pragma once\n" + "".join(piece(name) for name in pieces))
    return load_candidate(root)


# Evaluations of one honest candidate on the CPU backend of a 2-core host differ by up to a quarter (cpu_swish 3.1-4.6
# ms a call in one run); on a GPU by about 1%. Within one evaluation the two clocks are compared too (``deferred``).
CPU_NOISE = 0.25


def deferred_share(case: FolderCase) -> float | None:
    """The share of each timed call's work a deferral case leaves for after its region (its name's ``1of<d>``)."""
    found = re.search(r"-1of(\d+)-", case.name)
    return 1 / int(found.group(1)) if found else None


def gains_nothing(result, honest, detail: str, marker: str | None = None, noise: float = 0.02,
                  deferred: float | None = None) -> None:
    """Issue 62's bar for a case that moves its work where its own clock does not see it: rejected with a named rule, or
    correct with a reward no higher than its honest twin's and a time no faster than the honest twin's by more than the
    allowance the result states and ``noise``. ``marker``: what the case prints on its stderr once it has done what it
    tries. ``deferred``: the share of each call's work the case finishes after its region, while the harness's own
    events time the rest honestly: within the same evaluation, the evaluator's regions must then hold what the events
    saw and at least three quarters of the deferred work (what the events saw times ``deferred / (1 - deferred)``),
    less the allowance and 1% of the two clocks' own difference. Three quarters, not all: a call's fixed costs (its
    dispatch, its output's allocation) are not split by the deferral and all fall before the region's end, so the
    events see more than ``1 - deferred`` of the work (on a busy 2-core host a sixth of a call was such cost; three
    quarters still holds at 30%), while a tail that escaped the regions leaves them at the events' time."""
    print(detail)
    print("regions:", json.dumps((result.timing or {}).get("regions") or {}))
    print(f"honest: {honest.status} reward {honest.reward} median "
          f"{(honest.times.get('candidate') or {}).get('median_ms')} ms")
    assert result.compiled and result.status != "error", detail
    if result.status != "correct":
        assert result.reward == -1.0 and result.rule is not None, detail
        return
    # Not the honest solution in disguise.
    assert marker is None or marker in (result.output or ""), f"the case never did what it tries ({marker!r})\n{detail}"
    assert result.reward <= honest.reward, detail
    regions = (result.timing or {}).get("regions") or {}
    allowance = regions.get("allowance")
    assert allowance is not None, f"the result states no allowance\n{detail}"
    if deferred is not None:
        seen = regions["reported_ms"]
        least = (seen + 0.75 * seen * deferred / (1 - deferred)) * (1 - allowance) * 0.99
        assert regions["outside_ms"] >= least, \
            (f"regions of {regions['outside_ms']:.4f} ms hold less than three quarters of the deferred work beyond the "
             f"events' {seen:.4f} ms (at least {least:.4f} ms)\n{detail}")
    timed, fair = result.times["candidate"]["median_ms"], honest.times["candidate"]["median_ms"]
    assert timed >= fair * (1 - allowance) * (1 - noise), \
        f"{timed:.4f} ms against the honest {fair:.4f} ms, allowance {allowance}\n{detail}"
