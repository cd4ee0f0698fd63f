"""An RL trainer's stream of new candidates through the evaluation service (issue 34).

One GPU and its host's cores, ``local_service`` (what ``cuda-agent serve`` runs), a fresh cache. For each
task (benchmarks/solutions_kb with its KernelBench task; ``--device cpu``: the bundled examples/cpu_*),
candidates as an agent writes them, each an edit of the kernel file of an earlier one, so the build
cache sees exactly one changed translation unit:

  honest  the solution as committed (correct, fast)
  slow    honest with the launch function run twice (correct: every launch rewrites its outputs from
          its inputs, so the second pass repeats the first; about twice the time)
  wrong   honest with one bug an agent makes (a dropped scale, a swapped index, ...): results far
          beyond tolerance (inputs are U[0,1), tolerance 1e-3 of each output's RMS)
  broken  wrong with a semicolon deleted (a syntax error), for every fourth task

Submitted round by round (round r: variant r of every task, tasks shuffled), ``--concurrency`` in
flight at a time (a trainer's batch). Reported: evaluations per GPU-hour, seconds from submission to
reward (median, p90), CPU-seconds per build (``build.cpu_s`` of the result: the compilers' and
linker's user+system time, read from the job's cgroup under bwrap (None without one) or from wait4
with ``--sandbox none``; None in trees that predate the field), the host's CPU-seconds over the
stream (/proc/stat: the whole host), GPU busy share (nvidia-smi utilization every 0.5 s), and each candidate's reward in the
stream against its reward alone afterwards (one at a time, warm cache): mismatches counted.
Rows are appended to ``OUT.jsonl`` as they finish (with ``submitted_s`` and ``at_s``: seconds into the pass
at submission and at the reward, the stream's timeline); the summary goes to ``--out`` (JSON).

    python3 benchmarks/rl_workload.py --device cuda --kernelbench KB.jsonl --out $OUT/rl_workload.json \\
        [--baseline-src .data/prev/src]
    python3 benchmarks/rl_workload.py --device cpu --tasks 2 --concurrency 2 --out /tmp/rl.json   # smoke
    python3 benchmarks/rl_workload.py --check-builds --device cuda --kernelbench KB.jsonl   # nvcc, no GPU

``--baseline-src`` runs the same stream again with another tree of the package (PYTHONPATH, in a
subprocess, its own fresh cache) and prints both. Only service APIs both trees have are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, examples, kernelbench_tasks  # noqa: E402

import cuda_agent  # noqa: E402
from cuda_agent import load_candidate  # noqa: E402
from cuda_agent.bench.solutions import task_of  # noqa: E402
from cuda_agent.service import Job, local_service  # noqa: E402

SOLUTIONS = ROOT / "benchmarks" / "solutions_kb"
VARIANTS = ("honest", "slow", "wrong", "broken")
EXPECTED = {"honest": "correct", "slow": "correct", "wrong": "incorrect", "broken": "failed"}
BROKEN_EVERY = 4  # the tasks at positions 0, 4, 8, 12 of the sorted set get a variant that does not compile

# One bug per task, as (old, new) in its kernel file, every occurrence replaced. Each changes results by far
# more than the tolerance on the task's U[0,1) inputs (noted where that needs the inputs' sign or size).
WRONG_EDITS = {
    "level1_1": [("Bs[kk][tx]", "Bs[tx][kk]")],  # the B tile read transposed
    "level1_8": [("Bs[kk][tx]", "Bs[tx][kk]")],
    "level1_3": [("B, n, static_cast<long long>(k) * n,", "B, n, 0LL,")],  # batch 0's B for every batch
    "level1_5": [("return v * p;", "return v + p;")],
    "level1_12": [("crow[j] = s * brow[j];", "crow[j] = brow[j];")],  # the diagonal's scale dropped
    "level1_20": [("return v > 0.0f ? v : v * p;", "return v > 0.0f ? v * p : v;")],  # inputs >= 0: all scaled
    "level1_22": [("return tanhf(v);", "return v / (1.0f + fabsf(v));")],  # a "fast tanh": 0.5 for tanh(1)=0.76
    "level1_23": [("y[i] = expf(v - m) * inv;", "y[i] = expf(v - m);")],  # not normalised
    "level1_24": [("const float shift = m + logf(s);", "const float shift = logf(s);")],  # the max left out
    "level1_36": [("sqrtf(acc / static_cast<float>(C) + eps)", "sqrtf(acc + eps)")],  # a sum, not the mean
    "level1_40": [("y[i] = (x[i] - mean) * rstd", "y[i] = x[i] * rstd")],  # not centred (mean 0.5)
    "level1_48": [("static_cast<float>(1.0 / static_cast<double>(R))", "1.0f")],  # the sum, not the mean
    "level1_49": [("(v > a || v != v) ? v : a", "(v < a || v != v) ? v : a")],  # the min
    "level1_88": [("return 0.5f * v * (1.0f +", "return v * (1.0f +")],
    "level1_94": [("out[0] = static_cast<float>(total / static_cast<double>(n));",
                   "out[0] = static_cast<float>(total);")],  # the sum of squares, not the mean
    "level2_12": [("const float v = (y[i] + b[col]) * mult;", "const float v = (y[i] + b[col]) + mult;")],
    "cpu_swish": [("y[i] = scale * v /", "y[i] = v /")],  # the scale (1.5) dropped
}

_LAUNCH = re.compile(r'extern "C" (int|void) (\w+_launch)\(([^)]*)\)\s*\{')


# -- candidates -------------------------------------------------------------------------------------

def kernel_file(candidate) -> str:
    """The one kernel file of a one-extension workspace candidate (not the binding, not the fixed files)."""
    units = [u for u in candidate.extensions[0].compile_units
             if u.startswith("kernels/") and not u.endswith("_binding.cpp")]
    if len(units) != 1:
        raise SystemExit(f"rl_workload: {candidate.origin} has kernel files {units}; its variants need exactly one.")
    return units[0]


def with_kernel(candidate, rel: str, text: str):
    ext = candidate.extensions[0]
    return dataclasses.replace(candidate, extensions=(dataclasses.replace(ext, sources={**ext.sources, rel: text}),))


def slow_text(text: str, where: str) -> str:
    """The launch function renamed ``*_once`` and called twice by a wrapper of the original name and
    signature: the binding is unchanged, the same kernels run, every output is written twice."""
    match = _LAUNCH.search(text)
    if not match:
        raise SystemExit(f"rl_workload: no extern \"C\" *_launch function in {where}; the slow variant wraps it.")
    ret, name, params = match.groups()
    args = ", ".join(re.findall(r"\w+", p)[-1] for p in params.split(",") if p.strip())
    # noinline: inlined twice, an optimiser may drop the first copy's stores (the second overwrites them)
    # and with them the extra work (plain C++ on the CPU backend; a CUDA launch is an opaque call anyway).
    renamed = (text[: match.start()] + f"__attribute__((noinline)) static {ret} {name}_once({params}) {{"
               + text[match.end():])
    if ret == "void":
        body = f"  {name}_once({args});\n  {name}_once({args});\n"
    else:  # a status code: stop at the first failure, as the original returns it
        body = f"  const {ret} first = {name}_once({args});\n  if (first != 0) return first;\n  return {name}_once({args});\n"
    return renamed + f'\n// Twice the work, the same result.\nextern "C" {ret} {name}({params}) {{\n{body}}}\n'


def wrong_text(text: str, task: str, where: str) -> str:
    edits = WRONG_EDITS.get(task)
    if edits is None:
        raise SystemExit(f"rl_workload: no wrong edit for task {task}; add one to WRONG_EDITS.")
    for old, new in edits:
        if old not in text:
            raise SystemExit(f"rl_workload: {where} has no {old!r}; update WRONG_EDITS[{task!r}].")
        text = text.replace(old, new)
    return text


def broken_text(text: str, where: str) -> str:
    """The first statement of the launch function loses its semicolon."""
    match = _LAUNCH.search(text)
    end = text.find(";", match.end()) if match else -1
    if end < 0:
        raise SystemExit(f"rl_workload: no statement in the launch function of {where} to break.")
    return text[:end] + text[end + 1:]


def variants_of(task_name: str, honest, broken: bool) -> dict:
    """The task's candidates in the order an agent writes them, each from an earlier one by one edit of
    the kernel file."""
    rel = kernel_file(honest)
    text = honest.extensions[0].sources[rel]
    where = f"{task_name}/{rel}"
    out = {"honest": honest, "slow": with_kernel(honest, rel, slow_text(text, where))}
    wrong = wrong_text(text, task_name, where)
    out["wrong"] = with_kernel(honest, rel, wrong)
    if broken:
        out["broken"] = with_kernel(honest, rel, broken_text(wrong, where))
    return out


def task_set(device: str, kernelbench: Path | None, limit: int | None) -> list[tuple[str, object, object]]:
    """(name, task, honest candidate): solutions_kb with its KernelBench tasks on cuda, examples/cpu_* on cpu."""
    if device == "cpu":
        found = list(examples("cpu"))
    else:
        if kernelbench is None or not kernelbench.is_file():
            raise SystemExit(f"rl_workload: --kernelbench {kernelbench} is not a file; pass kernelbench.jsonl "
                             "(or set KERNELBENCH_DATA to its folder).")
        folders = sorted(SOLUTIONS.glob("level*"), key=lambda p: task_of(Path(p.name)) or (0, 0))
        tasks = kernelbench_tasks(kernelbench, [folder.name for folder in folders])
        found = [(folder.name, task, load_candidate(folder)) for folder, task in zip(folders, tasks)]
    return found[:limit] if limit else found


def stream_of(tasks: list, seed: int) -> list[dict]:
    """Round r holds variant r of every task that has one, tasks in a shuffled order per round: a trainer
    samples many tasks per batch, and a task's next attempt comes after others."""
    per_task = {name: variants_of(name, honest, i % BROKEN_EVERY == 0) for i, (name, _, honest) in enumerate(tasks)}
    task_of_name = {name: task for name, task, _ in tasks}
    rng = random.Random(seed)
    items = []
    for variant in VARIANTS:
        names = [n for n in per_task if variant in per_task[n]]
        rng.shuffle(names)
        for name in names:
            items.append({"index": len(items), "task": name, "variant": variant, "task_obj": task_of_name[name],
                          "candidate": per_task[name][variant]})
    return items


# -- measuring --------------------------------------------------------------------------------------

class GpuSampler:
    """utilization.gpu and memory.used of one GPU every ``every`` s from nvidia-smi, on a thread; None without
    nvidia-smi."""

    def __init__(self, gpu: int, every: float = 0.5):
        self.gpu, self.every = gpu, every
        self.samples: list[float] = []
        self.memory_mib: list[float] = []
        self.memory_total_gib: float | None = None
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def __enter__(self) -> "GpuSampler":
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                out = subprocess.run(["nvidia-smi", "-i", str(self.gpu),
                                      "--query-gpu=utilization.gpu,memory.used,memory.total",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                busy, used, total = (float(x) for x in out.stdout.strip().splitlines()[0].split(","))
                self.samples.append(busy)
                self.memory_mib.append(used)
                self.memory_total_gib = round(total / 1024, 1)
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                pass  # a missed sample; the share is over those taken
            self._stop.wait(max(0.0, self.every - (time.monotonic() - began)))

    def share(self) -> float | None:
        return round(statistics.fmean(self.samples) / 100, 4) if self.samples else None

    def memory_peak_gib(self) -> float | None:
        """The most device memory in use at any sample (every process on the GPU), what sizes ``apart``."""
        return round(max(self.memory_mib) / 1024, 1) if self.memory_mib else None


def host_cpu_s() -> float:
    """CPU-seconds the whole host has run (``/proc/stat``: all but idle and iowait). Not this process's
    RUSAGE_CHILDREN: bwrap's outer process exits without reaping its init, so the sandboxed compilers and
    workers never reach our children's usage. Meaningful on a host that runs nothing else (the GPU
    machine); on a shared one it counts the neighbours too."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def row_of(item: dict, reply, latency: float, phase: str) -> dict:
    result = reply.result if reply.ok and isinstance(reply.result, dict) else {}
    notes = result.get("notes") or []
    build = result.get("build") or {}
    units = build.get("units") or []
    return {
        "phase": phase, "index": item["index"], "task": item["task"], "variant": item["variant"],
        "expected": EXPECTED[item["variant"]], "status": result.get("status", f"service-{reply.kind}"),
        "reward": result.get("reward"), "stage": result.get("stage"), "rule": result.get("rule"),
        "reason": (result.get("reason") or reply.error or "")[:300], "latency_s": round(latency, 3),
        "speedup_eager": result.get("speedup_eager"), "speedup_compile": result.get("speedup_compile"),
        "build_ok": build.get("ok"), "build_cached": build.get("cached"), "build_s": build.get("seconds"),
        "build_cpu_s": build.get("cpu_s"),  # absent in trees before the field: None
        "units_compiled": sorted(u["unit"] for u in units if not u.get("reused")),
        "units_reused": sorted(u["unit"] for u in units if u.get("reused")),
        "durations": result.get("durations") or {},
        # Out of GPU memory beside another slot's evaluation, then evaluated again with the GPU alone.
        "reran_alone": any("evaluated again with the GPU alone" in n for n in notes),
        # Where its final attempt ran: beside the others, apart from other memory-hungry ones, or alone.
        "memory_step": memory_step(notes),
        "reference_dropped": any("reference process was not kept" in n for n in notes),
        # Whether its task's reference process was kept from an earlier evaluation or started for this one.
        "reference_kept": any(n.startswith("reference process kept") for n in notes),
        # What its reference held of the GPU once idle (GiB), where it could be kept: the pool's bound is sized by it.
        "reference_gib": reference_gib(notes),
    }


def reference_gib(notes: list[str]) -> float | None:
    for note in notes:
        if note.startswith("reference process idle: "):
            return float(note.removeprefix("reference process idle: ").split()[0])
    return None


def memory_step(notes: list[str]) -> str:
    if any("with the GPU alone" in n for n in notes):
        return "alone"
    return "apart" if any("apart from other memory-hungry" in n for n in notes) else "shared"


def run_pass(service, items: list[dict], concurrency: int, phase: str, rows_path: Path, deadline: float) -> list[dict]:
    """Keep ``concurrency`` jobs in flight (1: one at a time) until every item is answered or, past
    ``deadline`` (monotonic), stop submitting and wait for those in flight."""
    rows: list[dict] = []
    began = time.monotonic()
    pending = list(items)
    flight: dict = {}  # future -> (item, submitted)
    finished: dict = {}

    def done_at(future) -> None:
        finished[future] = time.monotonic()  # the reward's arrival, whatever the main loop is doing

    while pending or flight:
        while pending and len(flight) < concurrency and time.monotonic() < deadline:
            item = pending.pop(0)
            submitted = time.monotonic()
            future = service.submit(Job("evaluate", item["task_obj"], item["candidate"]))
            flight[future] = (item, submitted)
            future.add_done_callback(done_at)
        if not flight:
            break  # past the deadline with nothing in flight
        ready, _ = wait(list(flight), return_when=FIRST_COMPLETED)
        for future in ready:
            item, submitted = flight.pop(future)
            arrived = finished.get(future, time.monotonic())
            row = row_of(item, future.result(), arrived - submitted, phase)
            # Seconds into the pass at submission and at the reward: the stream's timeline, so that two
            # trees' runs can be compared over the same candidates where one was cut by its budget.
            row["submitted_s"], row["at_s"] = round(submitted - began, 3), round(arrived - began, 3)
            rows.append(row)
            with open(rows_path, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            flag = "" if row["status"] == row["expected"] else f"  (expected {row['expected']})"
            built = ("build cached" if row["build_cached"] else
                     f"build {row['build_s'] or 0:.1f} s, {_num(row['build_cpu_s'])} CPU-s, compiled "
                     f"{', '.join(row['units_compiled']) or 'nothing'}")
            print(f"[{phase} {len(rows)}/{len(items)}] {row['task']} {row['variant']}: {row['status']} reward "
                  f"{row['reward']} in {row['latency_s']:.1f} s ({built}){flag}", flush=True)
    if pending:
        print(f"[{phase}] deadline reached: {len(pending)} candidate(s) not submitted", flush=True)
    return rows


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarise(args, stream: list[dict], alone: list[dict], seconds: float, cpu_s: float, gpu_share, stats: dict) -> dict:
    latencies = [r["latency_s"] for r in stream]
    built = [r for r in stream if r["build_ok"] is not None and not r["build_cached"]]
    cpu = [r["build_cpu_s"] for r in built if r["build_cpu_s"] is not None]
    by_key = {(r["task"], r["variant"]): r for r in alone}
    pairs = [(r, by_key[(r["task"], r["variant"])]) for r in stream if (r["task"], r["variant"]) in by_key]
    mismatches = [{"task": s["task"], "variant": s["variant"], "stream": [s["status"], s["reward"]],
                   "alone": [a["status"], a["reward"]]} for s, a in pairs
                  if (s["status"], s["reward"]) != (a["status"], a["reward"])]
    return {
        "tree": str(Path(cuda_agent.__file__).resolve().parents[1]), "device": args.device,
        "tasks": len({r["task"] for r in stream}), "concurrency": args.concurrency, "seed": args.seed,
        "evaluations": len(stream), "stream_s": round(seconds, 1),
        "per_gpu_hour": round(len(stream) / seconds * 3600, 1) if seconds > 0 else None,
        "latency_median_s": round(statistics.median(latencies), 2) if latencies else None,
        "latency_p90_s": round(percentile(latencies, 0.9), 2) if latencies else None,
        "builds": len(built), "build_cpu_s_median": round(statistics.median(cpu), 2) if cpu else None,
        "build_cpu_s_mean": round(statistics.fmean(cpu), 2) if cpu else None,
        "build_cpu_s_total": round(sum(cpu), 1) if cpu else None,
        "host_cpu_s_per_eval": round(cpu_s / len(stream), 2) if stream and cpu_s is not None else None,
        "gpu_busy_share": gpu_share, "slot_busy_share": stats.get("busy_share"),
        "reran_alone": sum(bool(r.get("reran_alone")) for r in stream),
        "apart": sum(r.get("memory_step") == "apart" for r in stream),
        "alone": sum(r.get("memory_step") == "alone" for r in stream),
        # Parts of an evaluation's stages spent waiting: for the exclusive side (neighbours' shares, or their
        # stops with --pause-neighbours), for NVML to call the GPU idle before baselines are timed to be cached
        # (with the device held), for a candidate process to be ready, to take a share behind timings, and (the
        # evaluations apart) for the turn of the one apart before. None in trees without them.
        **{f"{wait}_median_s": _median([r["durations"][wait] for r in stream if wait in r["durations"]])
           for wait in ("wait_timing", "wait_idle", "wait_ready", "wait_share", "wait_apart")},
        "unexpected": [{"task": r["task"], "variant": r["variant"], "status": r["status"], "reason": r["reason"]}
                       for r in stream if r["status"] != r["expected"]],
        "by_variant": {v: {"n": sum(r["variant"] == v for r in stream),
                           "as_expected": sum(r["variant"] == v and r["status"] == EXPECTED[v] for r in stream),
                           "latency_median_s": _median([r["latency_s"] for r in stream if r["variant"] == v])}
                       for v in VARIANTS},
        "compared": len(pairs), "mismatches": len(mismatches), "mismatch_rows": mismatches,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def table(summaries: list[tuple[str, dict]]) -> str:
    fields = [("evaluations", "evaluations"), ("warm-up before the clock, s", "warmup_s"), ("stream seconds", "stream_s"), ("evaluations per GPU-hour" if
              summaries[0][1]["device"] == "cuda" else "evaluations per host-hour", "per_gpu_hour"),
              ("submission to reward, median s", "latency_median_s"), ("submission to reward, p90 s", "latency_p90_s"),
              ("builds (not cached whole)", "builds"), ("CPU-s per build, median", "build_cpu_s_median"),
              ("CPU-s per build, mean", "build_cpu_s_mean"), ("host CPU-s per evaluation (/proc/stat)", "host_cpu_s_per_eval"),
              ("GPU busy share", "gpu_busy_share"), ("GPU memory in use, peak GiB", "gpu_memory_peak_gib"),
              ("slot busy share", "slot_busy_share"),
              ("waiting for the timing side, median s", "wait_timing_median_s"),
              ("waiting for NVML's idle GPU (device held), median s", "wait_idle_median_s"),
              ("waiting for a candidate process, median s", "wait_ready_median_s"),
              ("waiting for a share behind timings, median s", "wait_share_median_s"),
              ("waiting for the apart turn (those apart), median s", "wait_apart_median_s"),
              ("evaluated again alone (out of memory beside another)", "reran_alone"),
              ("evaluated apart from memory-hungry ones", "apart"), ("evaluated with the GPU alone", "alone"),
              ("status not as intended", "unexpected"), ("stream vs alone compared", "compared"),
              ("reward mismatches", "mismatches")]
    lines = ["| | " + " | ".join(name for name, _ in summaries) + " |", "|---" * (len(summaries) + 1) + "|"]
    for label, key in fields:
        cells = [s.get(key) for _, s in summaries]
        cells = [len(c) if isinstance(c, list) else c for c in cells]
        lines.append(f"| {label} | " + " | ".join(_num(c) for c in cells) + " |")
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------------

def check_builds(args, items: list[dict]) -> None:
    """Compile each variant's kernel file alone with the project's compile-only build (no GPU needed):
    the kernel file is the only one that differs between a task's variants. The honest, slow and wrong
    ones must compile, the broken ones must not."""
    from cuda_agent.build import compile_only

    cache = Path(tempfile.mkdtemp(prefix="rl-workload-check-", dir=args.cache_dir))
    backend = "cuda" if args.device == "cuda" else "cpu"
    bad = 0
    try:
        for item in items:
            candidate = item["candidate"]
            rel = kernel_file(candidate)
            ext = candidate.extensions[0]
            alone = dataclasses.replace(candidate, extensions=(dataclasses.replace(ext, sources={rel: ext.sources[rel]}),))
            result = compile_only(alone, backend, cache_dir=cache)
            intended = item["variant"] != "broken"
            bad += result.ok != intended
            first = next((str(d) for d in result.diagnostics if d.severity == "error"), result.error or "")
            print(f"{item['task']:10s} {item['variant']:7s} {'compiles' if result.ok else 'fails'}"
                  f"{'' if result.ok == intended else '  NOT AS INTENDED'}  {first[:160]}", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"{len(items) - bad}/{len(items)} as intended")
    raise SystemExit(1 if bad else 0)


def run(args, earlier: list[dict] | None = None) -> dict:
    """One tree's run; ``earlier``: an earlier run's stream rows (``--alone-of``), only the pass alone then."""
    tasks = task_set(args.device, args.kernelbench, args.tasks)
    items = stream_of(tasks, args.seed)
    if args.check_builds:
        check_builds(args, items)
    counts = ", ".join(f"{v} {sum(i['variant'] == v for i in items)}" for v in VARIANTS)
    print(f"package {Path(cuda_agent.__file__).resolve().parent}; {len(tasks)} task(s), {len(items)} candidates "
          f"({counts}), concurrency {args.concurrency}", flush=True)
    rows_path = args.out.with_suffix(".jsonl")
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    rows_path.write_text("")
    cache = Path(tempfile.mkdtemp(prefix="rl-workload-", dir=args.cache_dir))  # fresh: every build is real
    options = {"cache_dir": cache}
    if args.reference_gib is not None:
        # What idle references may hold together (ReferencePool.bound takes the larger of this and the card's
        # memory less 64 GiB): under session 55's 28 GB the GB-input tasks' references closed each other.
        options["reference_memory"] = int(args.reference_gib * 1024**3)
    if args.sandbox:
        options["sandbox"] = args.sandbox
    # Options only where asked, so that a baseline tree older than them runs as it always did.
    paused = {"pause_neighbours": True} if args.pause_neighbours else {"pause_neighbours": False} if args.no_pause else {}
    paused |= {"apart": args.apart} if args.apart != 1 else {}
    if args.device == "cuda":
        # Slots sharing the GPU: timing alone, the rest side by side.
        shared = {"per_gpu": args.per_gpu} if args.per_gpu > 1 else {}
        service = local_service("cuda", gpus=[args.gpu], queue_size=max(64, args.concurrency), **shared, **paused,
                                **options)
    else:
        service = local_service("cpu", slots=args.slots, queue_size=max(64, args.concurrency), **paused, **options)
    warmup = None
    try:
        if args.warmup:
            warmup = warm_up(service, args.device, args.warmup)
        started, cpu0 = time.monotonic(), host_cpu_s()
        deadline = started + args.max_seconds if args.max_seconds else float("inf")
        if earlier is not None:
            # The stream ran in an earlier call (a device call holds the stream or the pass alone, not both):
            # its rows stand for it, and the whole budget goes to the pass alone.
            stream = [r for r in earlier if r["phase"] == "stream"]
            sampler, stats, cpu_s = _NoSampler(), {}, None
            seconds = max((r["at_s"] for r in stream), default=0.0)
        else:
            with GpuSampler(args.gpu) if args.device == "cuda" else _NoSampler() as sampler:
                # Past 60% of the budget the stream submits nothing new, leaving the rest to the second pass
                # (90% where there is none: what is in flight then still finishes).
                share = 0.9 if args.no_alone else 0.6
                stream = run_pass(service, items, args.concurrency, "stream", rows_path,
                                  started + share * (deadline - started) if args.max_seconds else deadline)
            seconds = time.monotonic() - started
            stats = service.stats()
            cpu_s = host_cpu_s() - cpu0
        answered = {(r["task"], r["variant"]) for r in stream}
        # An earlier call's pass alone (cut by its budget) already compared some: only the rest run again.
        before = [r for r in earlier or [] if r["phase"] == "alone"]
        answered -= {(r["task"], r["variant"]) for r in before}
        alone = [] if args.no_alone else before + run_pass(
            service, [i for i in items if (i["task"], i["variant"]) in answered], 1, "alone", rows_path, deadline)
    finally:
        service.close()
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    summary = summarise(args, stream, alone, seconds, cpu_s, sampler.share(), stats)
    summary["alone_of"] = str(args.alone_of) if args.alone_of else None
    summary["pause_neighbours"] = not args.no_pause
    summary["reference_bound_gib"] = args.reference_gib
    summary["apart_slots"] = args.apart
    summary["gpu_memory_peak_gib"] = sampler.memory_peak_gib()
    summary["gpu_memory_gib"] = sampler.memory_total_gib
    summary["gpu_samples"] = len(getattr(sampler, "samples", []))
    summary["warmup"] = warmup
    summary["warmup_s"] = warmup["seconds"] if warmup else None
    return summary


def earlier_stream(path: Path) -> list[dict]:
    """The stream rows of an earlier run's .jsonl (``--alone-of``), to compare the pass alone with, and the
    rows of its own pass alone if it had one (those candidates are not evaluated alone again)."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"rl_workload: --alone-of {path}: not a readable rows file ({exc}); give the .jsonl an "
                         "earlier run wrote beside its summary") from None
    if not any(row.get("phase") == "stream" for row in rows):
        raise SystemExit(f"rl_workload: --alone-of {path}: no stream rows in it")
    return [row for row in rows if row.get("phase") in ("stream", "alone")]


def warm_up(service, device: str, name: str) -> dict:
    """One evaluation of example ``name`` before the stream's clock starts: what a service that has run for
    a while has done once (the toolchain probe, the build units every candidate shares, the first CUDA and
    torch.compile start-up on the machine), so that the stream measures the steady state of both trees."""
    _, task, candidate = next(examples(device, [name]))
    clock = time.monotonic()
    reply = service.submit(Job("evaluate", task, candidate)).result()
    status = reply.result.get("status") if reply.ok and isinstance(reply.result, dict) else f"service-{reply.kind}"
    seconds = round(time.monotonic() - clock, 1)
    print(f"warm-up: {name} {status} in {seconds} s (before the stream's clock)", flush=True)
    return {"example": name, "status": status, "seconds": seconds}


class _NoSampler:
    samples: list[float] = []
    memory_total_gib = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def share(self) -> None:
        return None

    def memory_peak_gib(self) -> None:
        return None


def baseline(args) -> dict | None:
    """The same stream with the package at ``--baseline-src``: a subprocess, so its imports are its own."""
    src = args.baseline_src.resolve()
    if not (src / "cuda_agent" / "__init__.py").is_file():
        raise SystemExit(f"rl_workload: --baseline-src {src} holds no cuda_agent package (want a tree's src/, e.g. "
                         "`git archive REV src | tar -x -C .data/prev` then .data/prev/src).")
    out = args.out.with_name(args.out.stem + ".baseline.json")
    argv = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--concurrency", str(args.concurrency),
            "--seed", str(args.seed), "--gpu", str(args.gpu), "--slots", str(args.slots), "--out", str(out)]
    for flag, value in (("--tasks", args.tasks), ("--kernelbench", args.kernelbench), ("--cache-dir", args.cache_dir),
                        ("--sandbox", args.sandbox), ("--max-seconds", args.max_seconds)):
        if value:
            argv += [flag, str(value)]
    argv += ["--no-alone"] if args.no_alone else []
    argv += ["--warmup", args.warmup] if args.warmup else []
    print(f"\nbaseline: {src}", flush=True)
    code = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=str(src))).returncode
    if code != 0 or not out.is_file():
        print(f"baseline run failed (exit {code}); its rows so far are in {out.with_suffix('.jsonl')}", flush=True)
        return None
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--kernelbench", type=Path, default=None,
                        help="kernelbench.jsonl (cuda; default $KERNELBENCH_DATA/kernelbench.jsonl)")
    parser.add_argument("--tasks", type=int, default=None, help="the first N tasks only")
    parser.add_argument("--concurrency", type=int, default=8, help="candidates in flight (a trainer's batch)")
    parser.add_argument("--seed", type=int, default=0, help="the stream's order")
    parser.add_argument("--gpu", type=int, default=0, help="the one GPU the service uses (cuda)")
    parser.add_argument("--slots", type=int, default=1, help="CPU slots (cpu)")
    parser.add_argument("--reference-gib", type=float, default=None, metavar="GIB",
                        help="GPU memory idle reference processes may hold together (default 16 GiB; the bound is "
                             "the larger of this and the card's memory less 64 GiB)")
    pause = parser.add_mutually_exclusive_group()
    pause.add_argument("--pause-neighbours", action="store_true",
                       help="slots that time stop the other slots' reference starts and torch.compile instead of "
                            "waiting for them (local_service's pause_neighbours; its default since session 56)")
    pause.add_argument("--no-pause", action="store_true",
                       help="slots that time wait for the other slots' shares to end (pause_neighbours=False; "
                            "the default since session 56 is to stop them)")
    parser.add_argument("--apart", type=int, default=1, metavar="N",
                        help="memory-hungry evaluations at once on the GPU (local_service's apart; default 1)")
    parser.add_argument("--per-gpu", type=int, default=1,
                        help="slots sharing the GPU through a DeviceLock (cuda; this tree only, the baseline runs 1)")
    parser.add_argument("--sandbox", default=None, help="the evaluator's sandbox (default: its own, auto)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the run's fresh cache directory is made (default $TMPDIR); removed at the end")
    parser.add_argument("--keep-cache", action="store_true")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="budget: no new stream submission past 60%% of it, no second-pass one past all of it")
    parser.add_argument("--no-alone", action="store_true", help="skip the second pass (rewards alone)")
    parser.add_argument("--alone-of", type=Path, default=None, metavar="ROWS.jsonl",
                        help="no stream: only the pass alone, over the candidates an earlier run's stream answered "
                             "(its .jsonl), compared with that stream's rewards")
    parser.add_argument("--warmup", default=None, metavar="EXAMPLE",
                        help="evaluate this example (examples/NAME, e.g. cuda_gelu) once before the stream's clock "
                             "starts, in both trees: the one-time start-up of a service left out of the rate")
    parser.add_argument("--baseline-src", type=Path, default=None, help="another tree's src/ to run the same stream with")
    parser.add_argument("--check-builds", action="store_true",
                        help="only compile each variant's kernel file (compile-only, no GPU) and check it builds as intended")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rl_workload.json",
                        help="summary JSON; rows go to the same name with .jsonl")
    args = parser.parse_args()
    if args.kernelbench is None and os.environ.get("KERNELBENCH_DATA"):
        args.kernelbench = Path(os.environ["KERNELBENCH_DATA"]) / "kernelbench.jsonl"
    if args.concurrency < 1:
        raise SystemExit("rl_workload: --concurrency must be at least 1")
    if args.warmup and not (ROOT / "examples" / args.warmup / "solution").is_dir():
        have = ", ".join(sorted(p.name for p in (ROOT / "examples").glob("*") if (p / "solution").is_dir()))
        raise SystemExit(f"rl_workload: --warmup {args.warmup}: no such example; use one of {have}.")

    if args.alone_of and (args.no_alone or args.baseline_src):
        raise SystemExit("rl_workload: --alone-of runs only the pass alone: drop --no-alone and --baseline-src")
    earlier = earlier_stream(args.alone_of) if args.alone_of else None  # a bad file is said before a service starts
    if args.max_seconds:
        # Every thread's stack, once, if this run is still going well past its budget: a run the device tool
        # killed at its 10-minute limit left one line and no clue (2026-12-01, the warm-up never answered).
        faulthandler.dump_traceback_later(1.15 * args.max_seconds + 30)
    summaries = [("this tree", run(args, earlier))]
    faulthandler.cancel_dump_traceback_later()  # the baseline tree, if any, is a process with a budget of its own
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summaries[0][1], indent=1))
    if args.baseline_src:
        other = baseline(args)
        if other:
            summaries.append(("baseline", other))
            args.out.write_text(json.dumps({**summaries[0][1], "baseline": other}, indent=1))
    for name, summary in summaries:
        print(f"\n{name} ({summary['tree']}): not as intended {summary['unexpected'] or 'none'}; "
              f"mismatches {summary['mismatch_rows'] or 'none'}")
    print(f"\n{args.device}, {summaries[0][1]['tasks']} task(s), concurrency {args.concurrency}, "
          f"{summaries[0][1]['date']}\n")
    if args.alone_of:
        print(f"(the stream's figures are those of the rows in {args.alone_of}; this run was the pass alone)\n")
    print(table(summaries))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.jsonl')}")


if __name__ == "__main__":
    main()
