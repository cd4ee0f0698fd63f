"""How long a changed candidate takes to build with the per-unit object cache, with and without the
precompiled header, in the same run, case by case.

Cases, each a call of ``build`` as the evaluator makes it (link mode by default):
  cold        a fresh cache directory: nothing built on this machine yet (the new builder also builds
              its precompiled header and binding.cpp here, once per toolchain)
  kernel_edit one line of the kernel file changed
  glue_edit   one line of the binding (glue) file changed
  new_cand    a second candidate sharing nothing with the first but binding.cpp
  concurrent  N threads building the same new candidate at once (an evaluator's build pool does this
              when a trainer sends duplicates); reports how many times each unit was compiled

Wall seconds and CPU seconds (user+sys of the compilers, from RUSAGE_CHILDREN) per case and variant.
Variants: ``cache`` (the builder with the precompiled header), ``cache_nopch`` (the header off:
CUDA_AGENT_BUILD_PCH=0). Variants alternate within each case so load drifts hit all alike.

    python3 benchmarks/build_speed.py --backend cpu  --out build_speed_cpu.json
    python3 benchmarks/build_speed.py --backend cuda --out /some/dir      # GPU host: nvcc, torch+cu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's package, whatever is installed

from cuda_agent.build import builder as new_builder  # noqa: E402
from cuda_agent.build.toolchain import detect_toolchain  # noqa: E402
from cuda_agent.candidates import Candidate, load_candidate  # noqa: E402
from cuda_agent.sandbox import make_sandbox  # noqa: E402

EXAMPLES = {"cpu": ("cpu_swish", None), "cuda": ("cuda_gelu", "cuda_row_softmax")}


def edit(candidate: Candidate, rel: str, old: str, new: str) -> Candidate:
    ext = candidate.extensions[0]
    text = ext.sources[rel]
    if old not in text:
        raise SystemExit(f"build_speed: {rel} has no {old!r} to edit; update the benchmark's edits for this example.")
    return dataclasses.replace(candidate, extensions=(dataclasses.replace(ext, sources={**ext.sources, rel: text.replace(old, new, 1)}),))


def renamed(candidate: Candidate, old: str, new: str) -> Candidate:
    """The same candidate with its op renamed everywhere: different files, only binding.cpp shared."""
    ext = candidate.extensions[0]
    sources = {}
    for rel, text in ext.sources.items():
        fixed = rel in ("binding.cpp", "binding_registry.h")
        sources[rel if fixed else rel.replace(old, new)] = text if fixed else text.replace(old, new)
    return dataclasses.replace(candidate, extensions=(dataclasses.replace(ext, sources=sources),),
                               model_new=candidate.model_new.replace(old, new))


def units_of(candidate: Candidate) -> tuple[str, str]:
    """(kernel file, glue file) of a one-kernel workspace."""
    units = candidate.extensions[0].compile_units
    kernel = next(u for u in units if u.startswith("kernels/") and not u.endswith("_binding.cpp"))
    glue = next(u for u in units if u.endswith("_binding.cpp"))
    return kernel, glue


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Variant:
    def __init__(self, name: str, backend: str, cache: Path, sandbox, mode: str):
        self.name, self.backend, self.cache, self.sandbox, self.mode = name, backend, cache, sandbox, mode

    def build(self, candidate: Candidate):
        # The env var is read at each call; builds of different variants never overlap in time.
        os.environ["CUDA_AGENT_BUILD_PCH"] = "0" if self.name == "cache_nopch" else "1"
        return new_builder.build(candidate, self.backend, mode=self.mode, cache_dir=self.cache, sandbox=self.sandbox)


def measure(variant: Variant, candidates: list[Candidate]) -> dict:
    """Build each candidate on its own thread, all at once (one candidate: a plain build)."""
    results: list = [None] * len(candidates)

    def one(i: int) -> None:
        results[i] = variant.build(candidates[i])

    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(candidates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"build_speed: {variant.name} failed to build: {failed[0].error}\n{failed[0].log[-3000:]}")
    row = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "builds": len(results),
           "cached_whole": sum(bool(r.cached) for r in results)}
    compiled = [u["unit"] for r in results for u in r.units if not u["reused"]]
    row["units_compiled"] = sorted(compiled)
    row["units_reused"] = sorted(u["unit"] for r in results for u in r.units if u["reused"])
    row["unit_seconds"] = {u["unit"]: u["seconds"] for r in results for u in r.units if not u["reused"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path,
                        help="X.json (writes X.json and X.md) or a directory (writes build_speed.json and .md there)")
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mode", choices=("link", "compile"), default="link",
                        help="link (what an evaluation builds; default) or compile (utils/compile.py)")
    parser.add_argument("--variants", default="cache,cache_nopch")
    parser.add_argument("--concurrent", type=int, default=4, help="threads building one candidate at once")
    parser.add_argument("--sandbox", default="none", help="none (default, as the issue measured) or bwrap/auto")
    parser.add_argument("--work", type=Path, default=None, help="where the fresh caches go (default: a temp dir)")
    args = parser.parse_args()

    variants_wanted = [v for v in args.variants.split(",") if v]
    unknown = set(variants_wanted) - {"cache", "cache_nopch"}
    if unknown:
        raise SystemExit(f"build_speed: unknown variant(s) {sorted(unknown)}; choose from cache, cache_nopch.")
    first, second = EXAMPLES[args.backend]
    base = load_candidate(ROOT / "examples" / first / "solution")
    kernel, glue = units_of(base)
    # One-line edits as an agent makes them: a changed constant in the kernel, a changed check in the glue.
    kernel_edit = edit(base, kernel, "{", "{ /* one line changed */")
    glue_edit = edit(base, glue, "auto ", "const auto ")
    # The CPU backend has one example: its op renamed in every file makes a second candidate.
    other = (load_candidate(ROOT / "examples" / second / "solution") if second
             else renamed(base, Path(kernel).stem, Path(kernel).stem + "_two"))
    fresh = edit(edit(base, kernel, "{", "{ /* another agent's variant */"), glue, "auto ", "auto /* v3 */ ")

    detect_toolchain(args.backend)  # detected before any clock starts, as the evaluator keeps it
    sandbox = make_sandbox(args.sandbox)
    work = Path(tempfile.mkdtemp(prefix="build-speed-", dir=args.work))
    variants = [Variant(v, args.backend, work / v, sandbox, args.mode) for v in variants_wanted]
    cases = [("cold", [base]), ("kernel_edit", [kernel_edit]), ("glue_edit", [glue_edit]), ("new_cand", [other]),
             ("concurrent", [fresh] * args.concurrent)]
    table: dict[str, dict[str, dict]] = {}
    try:
        for case, candidates in cases:
            table[case] = {}
            for variant in variants:
                row = measure(variant, candidates)
                table[case][variant.name] = row
                print(f"{case:12s} {variant.name:12s} wall {row['wall_s']:7.2f} s  cpu {row['cpu_s']:7.2f} s  "
                      f"compiled {row['units_compiled']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    toolchain = detect_toolchain(args.backend)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
        "cpu_model": _cpu_model(), "python": platform.python_version(), "torch": toolchain.torch_version,
        "cxx": toolchain.cxx_version, "nvcc": toolchain.nvcc_version, "arch": toolchain.arch,
        "backend": args.backend, "mode": args.mode, "sandbox": args.sandbox, "examples": [first, second],
        "baseline": "cache_nopch (the precompiled header off)", "commit": _commit(),
    }
    # --out X.json writes X.json and X.md; any other --out is a directory for build_speed.{json,md}.
    target = args.out if args.out.suffix == ".json" else args.out / "build_speed.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"meta": meta, "cases": table}, indent=1))
    target.with_suffix(".md").write_text(render(meta, table, [v.name for v in variants], args.concurrent))
    print(f"wrote {target} and {target.with_suffix('.md')}")


def render(meta: dict, table: dict, names: list[str], concurrent: int) -> str:
    lines = [f"# Build speed, {meta['backend']} backend ({meta['mode']} mode), {meta['date']}", "",
             f"Host {meta['host']}: {meta['cpus']} cores ({meta['cpu_model']}), load average at the end "
             f"{', '.join(f'{x:.1f}' for x in meta['load_avg_at_end'])}; Python {meta['python']}, torch {meta['torch']}, "
             f"{meta['cxx']}" + (f", {meta['nvcc']}, arch {','.join(meta['arch'])}" if meta["nvcc"] else "")
             + f"; sandbox {meta['sandbox']}; examples {', '.join(e for e in meta['examples'] if e)}; baseline {meta['baseline']}.",
             "", "| case | " + " | ".join(f"{n} wall s | {n} CPU s" for n in names) + " | units compiled (" + names[-1] + ") |",
             "|---" * (2 * len(names) + 2) + "|"]
    for case, rows in table.items():
        label = case if case != "concurrent" else f"concurrent x{concurrent}"
        cells = " | ".join(f"{rows[n]['wall_s']:.1f} | {rows[n]['cpu_s']:.1f}" for n in names)
        compiled = rows[names[-1]]["units_compiled"]
        lines.append(f"| {label} | {cells} | {', '.join(compiled) or 'none'} |")
    lines += ["", "CPU s: user+sys of every compiler and linker process the case ran (RUSAGE_CHILDREN). "
              "`cache`'s cold case includes building the glue's precompiled header, once per toolchain and cache "
              "(the table lists units only).", ""]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    main()
