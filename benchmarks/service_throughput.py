"""Evaluations per hour through the evaluation service against ``evaluate_many`` (the anchor), in one run.

The same jobs (each bundled example of the device, repeated) go through:
  1. ``evaluate_many`` (one evaluator per GPU, or ``--slots`` on the CPU; a CPU build pool);
  2. ``local_service`` (the service's per-slot logic without Ray: what ``cuda-agent serve`` runs), jobs
     submitted in-process;
  3. the same service behind its HTTP front, through ``RemoteEvaluator`` clients (what ``--remote`` costs).
Each pass starts after a warm-up pass that builds and caches everything, so what is compared is the
scheduling, not the compiler. Prints a table and writes JSON.

    python benchmarks/service_throughput.py --device cuda --repeats 8 --out $OUT/service_throughput.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import examples  # noqa: E402

from cuda_agent.evaluate import resolve_device  # noqa: E402
from cuda_agent.evaluate.pool import evaluate_many  # noqa: E402
from cuda_agent.paths import cache_root  # noqa: E402
from cuda_agent.service import Job, RemoteEvaluator, local_service, make_server  # noqa: E402


def summarise(name: str, seconds: float, results: list, latencies: list[float]) -> dict:
    statuses = [r["status"] if isinstance(r, dict) else r.status for r in results]
    return {"path": name, "jobs": len(results), "seconds": round(seconds, 2),
            "per_hour": round(len(results) / seconds * 3600, 1),
            "latency_median_s": round(statistics.median(latencies), 2) if latencies else None,
            "correct": statuses.count("correct")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=4, help="jobs per example in each pass")
    parser.add_argument("--slots", type=int, default=1, help="CPU slots (GPU: one per visible GPU)")
    parser.add_argument("--examples", nargs="*", default=None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = resolve_device(args.device)
    cache = args.cache_dir or cache_root()
    pairs = [(task, candidate) for _, task, candidate in examples(device, args.examples)] * args.repeats
    options = {"cache_dir": cache}
    rows = []

    print(f"warm-up: {len(pairs) // args.repeats} example(s), builds and baselines cached", file=sys.stderr, flush=True)
    evaluate_many(pairs[: len(pairs) // args.repeats], device, slots=args.slots, **options)

    start = time.perf_counter()
    done: dict[int, float] = {}
    results = evaluate_many(pairs, device, slots=args.slots, on_result=lambda i, r: done.setdefault(i, time.perf_counter()),
                            **options)
    rows.append(summarise("evaluate_many", time.perf_counter() - start, results, []))
    print(rows[-1], file=sys.stderr, flush=True)

    service = local_service(device, slots=args.slots, queue_size=len(pairs), **options)
    try:
        start = time.perf_counter()
        futures = [service.submit(Job("evaluate", task, candidate)) for task, candidate in pairs]
        replies = [f.result() for f in futures]
        rows.append(summarise("service (in process)", time.perf_counter() - start, [r.result for r in replies],
                              [r.seconds for r in replies]))
        print(rows[-1], file=sys.stderr, flush=True)

        server = make_server(service, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        remote = RemoteEvaluator(f"http://127.0.0.1:{server.server_address[1]}")
        latencies: list[float] = []

        def one(pair):
            began = time.perf_counter()
            result = remote.evaluate(*pair)
            latencies.append(time.perf_counter() - began)
            return result

        start = time.perf_counter()
        with ThreadPoolExecutor(2 * service.info["slots_total"]) as pool:
            results = list(pool.map(one, pairs))
        rows.append(summarise("service over HTTP", time.perf_counter() - start, results, latencies))
        rows[-1]["stats"] = {k: v for k, v in remote.stats().items() if k in ("busy_share", "counts", "per_second")}
        print(rows[-1], file=sys.stderr, flush=True)
        server.shutdown()
    finally:
        service.close()

    anchor = rows[0]["per_hour"]
    print(f"\n{device}, {len(pairs)} evaluations per pass ({args.repeats} x each example), "
          f"{service.info['slots_total']} slot(s)\n")
    print("| path | evaluations | seconds | per hour | vs evaluate_many | median latency s | correct |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['path']} | {row['jobs']} | {row['seconds']} | {row['per_hour']} | "
              f"{row['per_hour'] / anchor:.2f}x | {row['latency_median_s'] or '-'} | {row['correct']}/{row['jobs']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device, "rows": rows, "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
