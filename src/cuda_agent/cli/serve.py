"""``cuda-agent serve``: an evaluation service (local slots or Ray actors) behind an HTTP front."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from cuda_agent.cli.common import (_memory_limit, _timeouts, add_device_option, add_memory_option, add_policy_option,
    add_sandbox_option, add_timeout_option, say)
from cuda_agent.evaluate import Policy


def cmd_serve(args: argparse.Namespace) -> int:
    """An evaluation service: local slots (or Ray actors with --ray) behind an HTTP front."""
    from cuda_agent.service import local_service, make_server, ray_service
    from cuda_agent.service.http import is_loopback
    from cuda_agent.service.messages import TOKEN_ENV

    if not (args.token or os.environ.get(TOKEN_ENV)) and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} reaches beyond this machine, so the service needs a token: pass --token "
                         f"TOKEN or set {TOKEN_ENV} (clients set {TOKEN_ENV} to the same value), or serve on 127.0.0.1")

    if args.per_gpu < 1:
        raise ValueError(f"--per-gpu must be at least 1 (local slots sharing each GPU), not {args.per_gpu}")
    policy = Policy.preset(args.policy)
    options = {"policy": policy, "cache_dir": args.cache_dir, "sandbox": args.sandbox, "timeouts": _timeouts(args),
               "memory_limit": _memory_limit(args)}

    def on_reply(job, reply) -> None:
        result = reply.result if reply.ok and isinstance(reply.result, dict) else {}
        outcome = ("no verdict (reward none)" if result.get("status") == "error" else
                   f"{result.get('status')} reward {result.get('reward')}") if "status" in result \
            else "ok" if reply.ok else f"{reply.kind}: {reply.error}"
        evaluations = f", {result['attempts']} evaluations" if result.get("attempts", 1) > 1 else ""
        say(f"[{time.strftime('%H:%M:%S')}] {job.describe()} -> {outcome} ({reply.slot}, {reply.seconds:.1f} s, "
            f"attempt {reply.attempts}{evaluations})")

    common = {"queue_size": args.queue_size, "job_timeout_s": args.job_timeout, "on_reply": on_reply}
    if args.ray:
        service = ray_service(args.ray, "cuda" if args.device == "auto" else args.device, slots=args.slots,
                              **common, **options)
    else:
        service = local_service(args.device, slots=args.slots, gpus=args.gpus, per_gpu=args.per_gpu, **common,
                                **options)
    try:
        server = make_server(service, args.host, args.port, token=args.token or os.environ.get(TOKEN_ENV))
    except OSError:
        service.close()  # its slots are running already
        raise
    host, port = server.server_address[:2]

    def stop(signum, frame) -> None:
        # SIGTERM (a supervisor's stop) closes the slots as Ctrl-C does; a second one must not cut that short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    info = service.info
    print(f"serving {info['slots_total']} {info['device']} slot(s) ({info['backend']}, policy {policy.name}) on "
          f"http://{host}:{port}  (cuda-agent eval TASK CANDIDATE --remote http://{host}:{port})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this family's commands to the top-level parser's subcommands."""
    p = sub.add_parser("serve", help="run an evaluation service: evaluators behind a queue and an HTTP front")
    add_device_option(p, "evaluate (--ray: cuda unless cpu is given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for "
                                                       "other machines)")
    p.add_argument("--port", type=int, default=8470, help="port (default 8470; 0 picks a free one, printed at start)")
    p.add_argument("--token", default=None,
                   help="bearer token every request must carry (default $CUDA_AGENT_SERVICE_TOKEN); required with a "
                        "--host beyond the loopback. Clients set CUDA_AGENT_SERVICE_TOKEN")
    p.add_argument("--slots", type=int, default=None,
                   help="evaluators: default one per GPU (cuda) or 1 (cpu); with --ray, actors (default: the cluster's GPUs)")
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU indices to serve on (default: all visible)")
    p.add_argument("--per-gpu", type=int, default=1, metavar="N",
                   help="local slots sharing each GPU (default 1): each times alone on it while the others load, "
                        "verify and read their outputs, so the GPU works between timings (memory: N reference "
                        "processes per GPU)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the slots as Ray actors on the cluster at ADDRESS ('local' starts one here; needs "
                        "the [ray] extra, pip install -e '.[ray]'; default: local processes)")
    add_policy_option(p)
    p.add_argument("--queue-size", type=int, default=64,
                   help="jobs that may wait (default 64); past it clients are told to retry")
    p.add_argument("--job-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="a job a slot holds longer fails as 'timeout' and the slot is replaced (default 3600)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="build and baseline cache (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda-agent; a shared "
                        "filesystem path shares it across nodes)")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_serve, kept=False)
