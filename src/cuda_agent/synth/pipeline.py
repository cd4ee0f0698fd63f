"""The synthesis run: compose -> filter -> append, in parallel, resumable.

Filters, in the order a candidate meets them (the first failure rejects it, with its reason):

``parse``          the program is a KernelBench-format task (static)
``decontaminated`` its ``Model`` is at most 0.9 similar to every KernelBench program (static)
``runs``           eager forward runs and returns finite floating-point tensors
``deterministic``  no stochastic catalog operator; two runs on the same inputs agree
``not_degenerate`` not constant, changes with the inputs, above the tolerance, and no trivial
                   candidate of the evaluation core (zeros, a constant, an input, its mean) passes
``runtime_window`` eager time on the target device within the window; a program outside it is
                   rescaled once along its batch dimension and checked again
``compiles``       torch.compile runs it and matches eager
``unique``         at most 0.9 similar to every task accepted before it (in index order)

Workers are threads that each own one sandboxed screening process
(``synth.screen``); timing takes a lock, so no two programs are timed at once.
Results are committed in index order, which makes a run with a given seed
reproducible (up to timing) and makes ``unique`` independent of scheduling.
Every screened candidate is appended to ``candidates.jsonl`` and every accepted
one to ``tasks.jsonl`` as it is committed; a rerun skips the ids already there.
"""

from __future__ import annotations

import json
import math
import queue
import secrets
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cuda_agent.scratch import made
from cuda_agent.candidates.triton import check_language
from cuda_agent.evaluate.protocol.policy import Policy
from cuda_agent.jsonl import read_jsonl
from cuda_agent.paths import PACKAGE_ROOT, cache_root, worker_env
from cuda_agent.sandbox.factory import make_sandbox
from cuda_agent.evaluate.protocol.channel import Channel, Stop
from cuda_agent.evaluate.protocol.messages import ScreenCheckRequest, ScreenCompileRequest, ScreenTimeRequest
from cuda_agent.sandbox.process import Limits, WorkerProcess
from cuda_agent.synth.catalog import Catalog
from cuda_agent.synth.compose import ComposeError, Program, SizeProfile, rescale
from cuda_agent.synth.decontaminate import THRESHOLD, Decontaminator
from cuda_agent.tasks.task import TaskError, check_task_source

__all__ = ["FILTERS", "WINDOWS_MS", "RUN_FILE", "CANDIDATES_FILE", "TASKS_FILE", "Composer", "SynthConfig", "Outcome",
           "Screener", "verdict", "Synthesis", "task_row", "load_references", "make_composer", "synthesize"]

FILTERS = ("parse", "decontaminated", "runs", "deterministic", "not_degenerate", "runtime_window", "compiles", "unique")
WINDOWS_MS = {"cuda": (1.0, 100.0), "cpu": (0.2, 200.0)}  # cuda: the paper's window; cpu: for CI and laptops
RUN_FILE = "run.json"
CANDIDATES_FILE = "candidates.jsonl"
TASKS_FILE = "tasks.jsonl"


class Composer(Protocol):
    name: str

    def compose(self, index: int) -> Program: ...


@dataclass
class SynthConfig:
    n: int  # accepted tasks wanted
    out: Path
    device: str = "cpu"
    composer: str = "program"
    seed: int = 0
    workers: int = 2
    window_ms: tuple[float, float] | None = None  # None: WINDOWS_MS[device]
    max_candidates: int | None = None  # None: 50 * n
    kernelbench: Path | None = None  # None: no decontamination (the run records that)
    sandbox: str = "auto"
    threshold: float = THRESHOLD
    timeout_s: float = 300.0
    policy: str = "fair"
    ray: str | None = None  # a Ray cluster address ("local": start one here); None: local processes
    cache_dir: Path | None = None  # None: paths.cache_root(); screeners compile into cache_dir/inductor
    language: str = "cuda"  # the kernels the tasks are for (a column of tasks.jsonl, which prompts made from it follow)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.n < 1:
            raise ValueError("--n must be at least 1.")
        if self.workers < 1:
            raise ValueError("--workers must be at least 1.")
        check_language(self.language)
        if self.device not in WINDOWS_MS:
            raise ValueError(f"unknown device {self.device!r}; use cuda or cpu.")
        if self.window_ms is None:
            self.window_ms = WINDOWS_MS[self.device]
        low, high = self.window_ms
        if not 0 < low < high:
            raise ValueError(f"the runtime window {low}..{high} ms is empty; give LOW < HIGH, both positive.")

    def identity(self) -> dict[str, Any]:
        """What must match for a rerun to resume this run."""
        return {"composer": self.composer, "seed": self.seed, "device": self.device,
                "window_ms": list(self.window_ms or ()), "threshold": self.threshold, "policy": self.policy,
                "kernelbench": str(self.kernelbench) if self.kernelbench else None}


@dataclass
class Outcome:
    """One screened candidate (a line of candidates.jsonl)."""

    id: str
    index: int
    accepted: bool
    verdicts: list[dict[str, Any]]
    program: Program | None = None
    ops: list[str] = field(default_factory=list)
    data_source: str = ""
    eager_ms: float | None = None
    compile_ms: float | None = None
    compile_seconds: float | None = None
    similarity: float | None = None
    closest: str | None = None
    rescaled_from: int | None = None
    seconds: float = 0.0

    @property
    def rejected_by(self) -> str | None:
        return next((v["filter"] for v in self.verdicts if not v["ok"]), None)

    def record(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "program"}
        return data | {"rejected_by": self.rejected_by, "composer": self.program.composer if self.program else None}


class Screener:
    """One sandboxed screening process, respawned after a crash or a time-out."""

    def __init__(self, config: SynthConfig, home: Path, cache: Path):
        self.config = config
        self.home = home
        self.cache = cache
        self.sandbox = make_sandbox(config.sandbox)
        self.worker: WorkerProcess | None = None
        self.channel: Channel | None = None
        policy = Policy.preset(config.policy)
        self.tolerance = policy.tolerance()
        self.tf32 = policy.tf32

    def _spawn(self) -> WorkerProcess:
        self.home.mkdir(parents=True, exist_ok=True)
        self.cache.mkdir(parents=True, exist_ok=True)
        env = worker_env(self.home, self.cache)
        argv = [sys.executable, "-m", "cuda_agent.synth.screen", "--device", self.config.device]
        if self.config.device == "cuda":
            argv += ["--memory-fraction", f"{0.9 / self.config.workers:.4f}"]
        return WorkerProcess(
            argv=argv,
            cwd=self.home, env=env, limits=Limits(timeout_s=24 * 3600.0), gpu=self.config.device == "cuda",
            sandbox=self.sandbox, writable=[self.cache], readable=[PACKAGE_ROOT],
        )

    def check(self, code: str, name: str, stochastic_ops: list[str]) -> list[dict[str, Any]]:
        """Filters runs, deterministic and not_degenerate; the process then holds the program."""
        path = self.home / "program.py"
        self.home.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        return self._ask(ScreenCheckRequest(path=str(path), name=name, **self.tolerance,
                                            seeds=[secrets.randbits(62) for _ in range(3)],
                                            stochastic_ops=stochastic_ops))["verdicts"]

    def time(self, compiled: bool = False) -> float:
        """Median ms of the held program under the policy's precision flags."""
        return self._ask(ScreenTimeRequest(compiled=compiled, tf32=self.tf32))["median_ms"]

    def compile(self) -> dict[str, Any]:
        """Filter compiles: ``{"verdict": ..., "compile_seconds": ...}``."""
        return self._ask(ScreenCompileRequest())

    def _ask(self, request: Any) -> dict[str, Any]:
        """The reply to ``request``; a ``RuntimeError`` where the program failed the process (its
        error answered: the process is kept) or killed it or ran out of time (respawned next time)."""
        if self.worker is None or self.channel is None:
            self.worker = self._spawn()
            self.channel = Channel(self.worker, "screening")
        try:
            return self.channel.ask("screen", request, self.config.timeout_s)
        except Stop as stop:
            if not stop.answered:
                self.close()
            raise RuntimeError(f"screening process: {stop.detail}") from None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            self.channel = None


def verdict(name: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
    return {"filter": name, "ok": ok, "reason": reason}


class Synthesis:
    """A synthesis run over ``config.out``; ``run()`` returns the outcomes it committed."""

    def __init__(self, config: SynthConfig, composer: Composer, catalog: Catalog,
                 references: list[tuple[str, str]] | None = None, progress: bool = True):
        self.config = config
        self.composer = composer
        self.catalog = catalog
        self.progress = progress
        self.profile = SizeProfile.for_device(config.device)
        self.decontaminator = Decontaminator(references or [], config.threshold)
        self.accepted = Decontaminator([], config.threshold)
        self._stochastic = {op.name for op in catalog.operators if op.stochastic}
        self._timing_lock = threading.Lock()
        self._stop = threading.Event()

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> list[Outcome]:
        out = self.config.out
        out.mkdir(parents=True, exist_ok=True)
        self._check_resume(out)
        done = read_jsonl(out / CANDIDATES_FILE)
        done_ids = {row["id"] for row in done}
        accepted = sum(row["accepted"] for row in done)
        for row in read_jsonl(out / TASKS_FILE):
            self.accepted.add(row["id"], row["code"])
        counts = {name: 0 for name in FILTERS}
        for row in done:
            if row.get("rejected_by"):
                counts[row["rejected_by"]] = counts.get(row["rejected_by"], 0) + 1
        limit = self.config.max_candidates or 50 * self.config.n
        # The evaluator's inductor cache (cache_dir/inductor), not one per output directory: with a cold cache
        # a process's first torch.compile builds inductor's precompiled header again (several times a warm
        # compile), once per run and worker; the cache is content-keyed and safe to share between processes.
        inductor = Path(self.config.cache_dir or cache_root()) / "inductor"
        scratch = made(Path(tempfile.mkdtemp(prefix="cuda-agent-synth-")))  # removed on Ctrl-C too
        screeners: queue.Queue[Screener] = queue.Queue()
        if self.config.ray:
            from cuda_agent.synth.ray_pool import ray_screeners

            for remote in ray_screeners(self.config):
                screeners.put(remote)  # type: ignore[arg-type]
        else:
            for slot in range(self.config.workers):
                screeners.put(Screener(self.config, scratch / f"slot{slot}", inductor))
        committed: list[Outcome] = []
        bar = _progress(self.config.n, accepted, self.progress)
        pending: dict[int, Future[Outcome]] = {}
        results: dict[int, Outcome] = {}
        indices = (i for i in range(limit) if _id_for(self.composer, i) not in done_ids)
        try:
            with ThreadPoolExecutor(self.config.workers) as pool, \
                    (out / CANDIDATES_FILE).open("a") as candidates_file, (out / TASKS_FILE).open("a") as tasks_file:
                order: list[int] = []
                while True:
                    while accepted + len(pending) < self.config.n + self.config.workers and len(pending) < 2 * self.config.workers:
                        index = next(indices, None)
                        if index is None:
                            break
                        order.append(index)
                        pending[index] = pool.submit(self._screen_one, index, screeners)
                    if not pending:
                        break
                    finished, _ = wait(list(pending.values()), return_when=FIRST_COMPLETED)
                    for index in [i for i, f in pending.items() if f in finished]:
                        results[index] = pending.pop(index).result()
                    # Commit in index order: ``unique`` then sees the same earlier tasks on every run.
                    while order and order[0] in results and accepted < self.config.n:
                        outcome = results.pop(order.pop(0))
                        self._commit(outcome, candidates_file, tasks_file)
                        committed.append(outcome)
                        if not outcome.accepted:
                            counts[outcome.rejected_by or "runs"] += 1
                        # The count of screened candidates goes in before the bar redraws: set after
                        # update(), it showed the previous count next to the new accepted one.
                        bar.set_postfix_str(_postfix(len(done) + len(committed), counts), refresh=False)
                        if outcome.accepted:
                            accepted += 1
                            bar.update(1)
                        else:
                            bar.refresh()
                    if accepted >= self.config.n:
                        self._stop.set()
                        break
        finally:
            self._stop.set()
            bar.close()
            while not screeners.empty():
                screeners.get().close()
            shutil.rmtree(scratch, ignore_errors=True)
        if accepted < self.config.n:
            print(f"synth: stopped after {limit} candidates with {accepted} of {self.config.n} tasks accepted "
                  "(raise --max-candidates, or widen --window-ms)", file=sys.stderr)
        return committed

    def _check_resume(self, out: Path) -> None:
        run_file = out / RUN_FILE
        identity = self.config.identity()
        if run_file.exists():
            previous = json.loads(run_file.read_text()).get("identity")
            if previous != identity:
                changed = sorted(k for k in identity if (previous or {}).get(k) != identity[k])
                raise ValueError(f"{out} holds a run with other settings ({', '.join(changed)}); resume it with the "
                                 "same settings or write to a new --out directory.")
            return
        from cuda_agent.synth.report import environment

        run_file.write_text(json.dumps({"identity": identity, "environment": environment(self.config.device),
                                        "started": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))

    def _commit(self, outcome: Outcome, candidates_file: Any, tasks_file: Any) -> None:
        if outcome.accepted and outcome.program is not None:
            match = self.accepted.match(outcome.program.code) if len(self.accepted) else None
            if match is not None and match.score > self.config.threshold:
                outcome.accepted = False
                outcome.verdicts.append(verdict("unique", False, f"{match.score:.3f} similar to {match.closest}"))
            else:
                outcome.verdicts.append(verdict("unique", True))
                self.accepted.add(outcome.id, outcome.program.code)
        candidates_file.write(json.dumps(outcome.record()) + "\n")
        candidates_file.flush()
        if outcome.accepted and outcome.program is not None:
            tasks_file.write(json.dumps(task_row(outcome, self.config.device, self.config.language)) + "\n")
            tasks_file.flush()

    # -- one candidate -----------------------------------------------------------------------
    def _screen_one(self, index: int, screeners: queue.Queue[Screener]) -> Outcome:
        started = time.perf_counter()
        if self._stop.is_set():
            return Outcome(_id_for(self.composer, index), index, False, [verdict("runs", False, "run stopped")])
        try:
            program = self.composer.compose(index)
        except ComposeError as exc:
            return Outcome(_id_for(self.composer, index), index, False, [verdict("parse", False, f"composer: {exc}")],
                           seconds=time.perf_counter() - started)
        outcome = Outcome(program.id, index, False, [], program, ops=list(program.ops), data_source=program.data_source)
        screener = screeners.get()
        try:
            self._filters(outcome, screener)
        except RuntimeError as exc:  # the screening process died or timed out: the program's fault
            outcome.verdicts.append(verdict("runs", False, str(exc)[:300]))
        finally:
            screeners.put(screener)
        outcome.accepted = all(v["ok"] for v in outcome.verdicts)
        outcome.seconds = time.perf_counter() - started
        return outcome

    def _filters(self, outcome: Outcome, screener: Screener) -> None:
        program = outcome.program
        assert program is not None
        try:
            check_task_source(program.code, program.id)
        except TaskError as exc:
            outcome.verdicts.append(verdict("parse", False, str(exc)))
            return
        outcome.verdicts.append(verdict("parse", True))
        if len(self.decontaminator):
            match = self.decontaminator.match(program.code)
            outcome.similarity, outcome.closest = round(match.score, 4), match.closest
            if match.score > self.config.threshold:
                outcome.verdicts.append(verdict("decontaminated", False,
                                                f"{match.score:.3f} similar to KernelBench {match.closest}"))
                return
            outcome.verdicts.append(verdict("decontaminated", True))
        else:
            outcome.verdicts.append(verdict("decontaminated", True, "no KernelBench programs given: not checked"))

        low, high = self.config.window_ms  # type: ignore[misc]
        for attempt in (0, 1):
            checked = self._check(program, screener)
            if not all(v["ok"] for v in checked):
                outcome.verdicts += checked
                return
            with self._timing_lock:
                eager = screener.time()
            outcome.eager_ms = round(eager, 4)
            if low <= eager <= high:
                outcome.verdicts += checked
                outcome.verdicts.append(verdict("runtime_window", True))
                break
            scaled = self._rescaled(program, eager) if attempt == 0 else None
            if scaled is None:
                outcome.verdicts += checked
                outcome.verdicts.append(verdict("runtime_window", False,
                                                f"eager {eager:.3g} ms outside {low:g}..{high:g} ms"))
                return
            outcome.rescaled_from = program.input_shapes[0][0]
            program = outcome.program = scaled
        reply = screener.compile()
        outcome.verdicts.append(reply["verdict"])
        if not reply["verdict"]["ok"]:
            return
        outcome.compile_seconds = round(reply["compile_seconds"], 2)
        with self._timing_lock:
            outcome.compile_ms = round(screener.time(compiled=True), 4)

    def _check(self, program: Program, screener: Screener) -> list[dict[str, Any]]:
        return screener.check(program.code, program.id, sorted(set(program.ops) & self._stochastic))

    def _rescaled(self, program: Program, eager_ms: float) -> Program | None:
        """The program with its batch scaled toward the window's low end (times grow about linearly
        with the batch), or None when the batch cannot move far enough."""
        if not program.input_shapes:
            return None  # an LLM's program: its sizes are its own
        low, high = self.config.window_ms  # type: ignore[misc]
        target = low * (high / low) ** 0.25
        lead = program.input_shapes[0][0]
        biggest = max(math.prod(s["out_shape"]) for s in program.steps) if program.steps else math.prod(program.input_shapes[0])
        new = max(1, round(lead * target / max(eager_ms, 1e-6)))
        new = min(new, max(1, int(lead * 2 * self.profile.max_elements / max(biggest, 1))))
        if new == lead:
            return None
        try:
            return rescale(program, new)
        except ComposeError:
            return None


def task_row(outcome: Outcome, device: str, language: str = "cuda") -> dict[str, Any]:
    """An accepted task: CUDA-Agent-Ops-6K's columns (code, ops, data_source) and our metadata, with the kernel
    language wanted (``language``)."""
    program = outcome.program
    assert program is not None
    return {
        "code": program.code, "ops": program.ops, "data_source": program.data_source,
        "id": program.id, "composer": program.composer, "seed": program.seed, "index": program.index,
        "device": device, "eager_ms": outcome.eager_ms, "compile_ms": outcome.compile_ms,
        "compile_seconds": outcome.compile_seconds, "input_shapes": program.input_shapes,
        "max_similarity": outcome.similarity, "closest_kernelbench": outcome.closest, "language": language,
    }


def _id_for(composer: Composer, index: int) -> str:
    from cuda_agent.synth.compose import program_id

    return program_id(composer.name, getattr(composer, "seed", 0), index)


def _postfix(screened: int, counts: dict[str, int]) -> str:
    rejected = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
    return f"screened {screened}" + (f" | rejected: {rejected}" if rejected else "")


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def refresh(self) -> None: ...
    def set_postfix_str(self, text: str, refresh: bool = True) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="task", desc="accepted", dynamic_ncols=True)


def load_references(path: Path | None) -> list[tuple[str, str]]:
    """KernelBench programs as (name, code) for decontamination."""
    if path is None:
        return []
    from cuda_agent.tasks.loaders import load_tasks

    return [(task.name, task.code) for task in load_tasks(path)]


def make_composer(config: SynthConfig, catalog: Catalog, **llm: Any) -> Composer:
    from cuda_agent.synth.compose import ProgramComposer

    if config.composer == "program":
        return ProgramComposer(catalog, SizeProfile.for_device(config.device), seed=config.seed)
    if config.composer == "llm":
        from cuda_agent.synth.llm import LLMComposer

        return LLMComposer(catalog, SizeProfile.for_device(config.device), seed=config.seed,
                           window_ms=config.window_ms, **llm)
    raise ValueError(f"unknown composer {config.composer!r}; use program or llm.")



def synthesize(config: SynthConfig, catalog: Catalog | None = None, progress: bool = True,
               **llm: Any) -> dict[str, Any]:
    """Run (or resume) a synthesis into ``config.out`` and write its report; the summary numbers.
    ``llm``: the LLM composer's options (model, base_url, api_key_env, ...)."""
    from cuda_agent.synth.catalog import default_catalog
    from cuda_agent.synth.report import finish

    catalog = catalog or default_catalog()
    composer = make_composer(config, catalog, **llm)
    Synthesis(config, composer, catalog, load_references(config.kernelbench), progress).run()
    return finish(config.out)
