#!/usr/bin/env bash
# Everything that needs the GPU, in as few device calls as possible; results land in $OUT.
#
#   bash benchmarks/gpu_session.sh tests     # the GPU test suite (KernelBench solutions, examples, faults)
#   bash benchmarks/gpu_session.sh release_stability # reward stability beside the CUDA Agent release (~8 min;
#                                            # carry .data): the timing tests, 10 warm evaluations of axpby,
#                                            # cuda_gelu, cuda_row_softmax 3 s apart, the release's scripts beside
#                                            # axpby and cuda_gelu
#   bash benchmarks/gpu_session.sh redteam   # the GPU red-team cases (SHARD=1/2, then SHARD=2/2: in two calls)
#   bash benchmarks/gpu_session.sh integrity_reads # a defence's cost: the in-round integrity read, or with
#                                            # DEFENCE=rerun the timed call run again (SPEED_EXAMPLES, VS_REPEATS)
#   bash benchmarks/gpu_session.sh outside_reads # timing/integrity tests, the GPU reads from outside and the
#                                            # quiet probe, the region red team (REDTEAM_K), brackets on 8 solutions
#                                            # (AGREEMENT_ONLY: names, or none; AGREEMENT_REPEATS: evaluations of each)
#   bash benchmarks/gpu_session.sh outside_clock # the evaluator's own clock: its tests, the red team's timing cases
#                                            # (CLOCK_REDTEAM=1, REDTEAM_K), the release's axpby and the examples
#                                            # (CLOCK_EXAMPLE_REPEATS), every other honest solution (CLOCK_REPEATS);
#                                            # CLOCK_TESTS=0: without the tests
#   bash benchmarks/gpu_session.sh agreement # the region red-team cases, then the region brackets' agreement for
#                                            # every honest solution (AGREEMENT_REDTEAM=0: the agreement alone; ~25 s
#                                            # a solution on the H200; extra arguments to clock_agreement.py: --only NAMES)
#   bash benchmarks/gpu_session.sh quiet     # probe: another context's GPU work seen from outside
#   bash benchmarks/gpu_session.sh clock_rate # probe: the host clocks' rate against the GPU's event timer
#   bash benchmarks/gpu_session.sh vmm       # probe: GPU output memory read from another sandbox
#   bash benchmarks/gpu_session.sh false_positives # the legitimate solutions only (false positives), then the
#                                            # evaluation's GPU memory per process (benchmarks/eval_memory.py)
#   bash benchmarks/gpu_session.sh trust_suite # the trust checks in one call: integrity and timing tests, the GPU
#                                            # red-team cases, the legitimate solutions (false positives)
#   bash benchmarks/gpu_session.sh speed     # eval speed and repeatability (~7 min)
#   bash benchmarks/gpu_session.sh vs_release  # speed and reward stability beside the CUDA Agent release's
#                                            # scripts (carry .data; extra arguments go to vs_release.py)
#   bash benchmarks/gpu_session.sh guard     # guard overhead
#   bash benchmarks/gpu_session.sh overhead  # eval_speed of this tree and of a carried .data/prev/src (the
#                                            # previous commit: git archive REV src | tar -x -C .data/prev),
#                                            # alternating, in one call (SPEED_EXAMPLES, VS_REPEATS,
#                                            # OVERHEAD_RUNS: e.g. "1-prev 2-this" for one run of each;
#                                            # "3-this+all": this tree with outside_inputs="all")
#   bash benchmarks/gpu_session.sh region_end_variants # end-of-region variants: rewards and spread over repeats
#   bash benchmarks/gpu_session.sh region_cost # a warm evaluation's steps by wall clock (SPEED_EXAMPLES, EVALUATIONS,
#                                            # PAUSE_POLLS: the stop's poll in ms, in turn)
#   bash benchmarks/gpu_session.sh eval_profile # one evaluation's requests as a timeline (PROFILE_SOLUTIONS=level1_20 ...)
#   bash benchmarks/gpu_session.sh verify_costs # one check's steps outside the evaluator (experiments/verify_costs.py)
#   bash benchmarks/gpu_session.sh profile   # eval_speed under cProfile, this tree and a carried .data/prev/src
#   bash benchmarks/gpu_session.sh bracket_excess # each evaluation's brackets against their limit, this tree and carried
#                                            # ones in turn (EXCESS_TREES="alt this": .data/alt/src, then src;
#                                            # "this+pause": every worker stop delayed 35 ms)
#   bash benchmarks/gpu_session.sh compile_noise # torch.compile's baseline: within a process, over time, fresh
#                                            # compilations (experiments/compile_noise_probe.py)
#   bash benchmarks/gpu_session.sh drift     # candidate timing over successive evaluations, with the clocks
#   bash benchmarks/gpu_session.sh precision # precision calibration (~1 min)
#   bash benchmarks/gpu_session.sh bench     # all three (over the device tool's 10-minute limit per call)
#   bash benchmarks/gpu_session.sh synth     # task synthesis with the GPU window (SYNTH_N, SYNTH_WORKERS,
#                                            # SYNTH_SECONDS); resumes from a carried .data/synth_h200:
#                                            # copy the fetched $OUT/synth_h200/* there before the next call
#   bash benchmarks/gpu_session.sh baselines # KernelBench L1-3 eager/compile table (BASELINES_SECONDS);
#                                            # resumes from a carried .data/baselines_<gpu>/baselines.jsonl
#   bash benchmarks/gpu_session.sh bench_own # cuda-agent bench over our KernelBench solutions, then the
#                                            # baselines table's retries (into $OUT/baselines_h200)
#   bash benchmarks/gpu_session.sh triton    # Triton candidates: the red team, ten evaluations of one solution, warm
#                                            # re-evaluation beside a CUDA one, the KernelBench solutions
#                                            # (tests/gpu/test_gpu_triton.py; TRITON_BUDGET_S, default 280: tests that
#                                            # would start later are skipped and listed) into $OUT/triton_gpu.{json,md}
#   bash benchmarks/gpu_session.sh verdict_rate # an honest cuda_gelu evaluation's verdicts with 0, half and all but two
#                                            # of the host's cores busy, one attempt and with retries (VERDICT_BUSY,
#                                            # VERDICT_REPEATS; VERDICT_ARGS: e.g. --region-memory-share 0.25)
#                                            # into $OUT/verdict_rate_gpu.json
#   bash benchmarks/gpu_session.sh counters  # hardware counters (tests/gpu/test_gpu_counters.py), raw ncu CSVs kept
#   bash benchmarks/gpu_session.sh service   # the evaluation service (local backend) vs evaluate_many (SERVICE_REPEATS)
#   bash benchmarks/gpu_session.sh rl_workload # an RL trainer's stream of new candidates (honest, slow, wrong,
#                                            # broken) through the local service: evaluations per GPU-hour, latency,
#                                            # CPU-s per build, GPU busy share, stream vs alone rewards; then the same
#                                            # stream with a carried .data/prev/src if there is one (RL_TASKS,
#                                            # RL_CONCURRENCY, RL_PER_GPU (slots sharing the GPU, this tree; default 2),
#                                            # RL_SECONDS: the budget of each tree's run; RL_TREE=this or
#                                            # prev: one tree alone in this call; RL_TREE=side: both at once,
#                                            # each on its own GPU (kind nvidia-h200-x2); RL_WARMUP=cuda_gelu: one
#                                            # evaluation of it before each tree's clock starts;
#                                            # RL_ALONE_OF=ROWS.jsonl: only the pass alone of an earlier stream;
#                                            # RL_NO_PAUSE=1: timing waits for other slots' reference starts
#                                            # (the default stops them; RL_PAUSE=1 for trees without it);
#                                            # RL_REFERENCE_GIB=N: what idle references may hold together;
#                                            # RL_APART=N: memory-hungry evaluations at once)
#   bash benchmarks/gpu_session.sh edit_to_reward # source to reward after a one-line kernel edit, this
#                                            # tree beside a carried .data/prev/src (EDITS, SPEED_EXAMPLES), then
#                                            # the shared GPU's out-of-memory rerun (tests/gpu/test_gpu_device_lock.py);
#                                            # EDIT_TREE=this: this tree's edits only
#   bash benchmarks/gpu_session.sh train_demo # cuda-agent train demo --device cuda (TRAIN_STEPS), into $OUT/train_demo
#   bash benchmarks/gpu_session.sh train_tests      # the training stages on the GPU (tests/gpu/test_gpu_train.py)
#   bash benchmarks/gpu_session.sh train_throughput # 0.5B/1.5B generation, evaluation and update at 32k
#                                            # (THROUGHPUT_ARGS go to benchmarks/train_throughput.py,
#                                            # THROUGHPUT_NAME names the output folder)
#   bash benchmarks/gpu_session.sh integrations # `trl grpo` one step (tiny model on the GPU, rewards from the CUDA
#                                            # evaluator), an episode through the OpenEnv package's server evaluated
#                                            # by the service on the GPU, and the scripted GRPOTrainer step and serve
#                                            # episode (tests/gpu/test_gpu_integrations.py); carry [".data", ".whl"]
#                                            # with the wheel set below
#   bash benchmarks/gpu_session.sh tests -k "illegal or profiler"   # extra arguments go to pytest; a tests/ path
#                                            # among them runs that file (or test) instead of the whole tests/gpu
#
# With the device tool, carry [".data"]. It holds:
#   .data/kernelbench/kernelbench.jsonl  (cp ../shared/data/kernelbench/{kernelbench.jsonl,h100_*.json} .data/kernelbench/)
#   .data/wheels/pyseccomp-*.whl         (pip download pyseccomp --no-deps -d .data/wheels)
#   .data/debs/bubblewrap_*.deb          (cd .data/debs && apt-get download bubblewrap)
#   .data/lib/libseccomp.so.2            (cp /usr/lib/x86_64-linux-gnu/libseccomp.so.2 .data/lib/)
# and, for the agent's GPU test, carry [".data", ".whl"] with the openai SDK and its dependencies:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 -d .whl \
#       openai pydantic pydantic-core jiter distro sniffio annotated-types typing-inspection httpx2 httpcore2 \
#       anyio truststore idna h11 typing-extensions   (the versions installed here)
# For `integrations`, carry [".data", ".whl"], .whl holding trl 1.16.0, openenv 0.10.0 and every dependency the
# device machine lacks (its list: /work/.library/device/KINDS.md, "Python packages already there"; it has torch,
# transformers, accelerate, pyarrow, pandas, httpx, rich, typer, ...), one version each, at the versions installed
# here (`pip show`): 67 wheels, 19 MiB. Made by walking Requires-Dist (with the extras asked for, e.g.
# fastmcp-slim[client,server]) from trl, datasets, openenv, uvicorn, websockets and fastmcp, leaving out what the device has
# and gradio (openenv imports its web UI only if gradio is there; create_fastapi_app does not need it), then
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl NAME==VERSION ...
# and checked with `python3 benchmarks/wheels_check.py .whl --roots trl datasets openenv uvicorn websockets fastmcp
# --skip gradio` (every requirement met on the device or in the folder, one version each). The openai SDK the
# agent's GPU test needs is in that set too.
# The device machine has no network: pyseccomp is installed from that wheel, and torch
# and the rest are what the machine has.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELBENCH_DATA=$PWD/.data/kernelbench
export CUDA_AGENT_TEST_CACHE=/dev/shm/cuda-agent-cache CUDA_AGENT_CACHE=/dev/shm/cuda-agent-cache TMPDIR=/dev/shm
python3 -c "import pyseccomp" 2>/dev/null || python3 -m pip install --no-index --no-deps -q .data/wheels/pyseccomp-*.whl
if [ "${1:-}" != integrations ] && ! python3 -c "import openai" 2>/dev/null && ls .whl/openai-*.whl >/dev/null 2>&1; then
    # The agent's model backend (the [llm] extra): carried wheels, see the comment at the top.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if ! command -v bwrap >/dev/null; then
    # The device image has no bubblewrap and no network: unpack the carried Debian package.
    deb=$(ls .data/debs/bubblewrap_*.deb 2>/dev/null | head -1)
    [ -n "$deb" ] || { echo "bwrap is missing: apt-get install bubblewrap, or carry .data/debs/bubblewrap_*.deb" >&2; exit 2; }
    dpkg -x "$deb" /tmp/bubblewrap && install -m 0755 /tmp/bubblewrap/usr/bin/bwrap /usr/local/bin/bwrap
fi
if ! ldconfig -p | grep -q libseccomp.so.2 && [ -f .data/lib/libseccomp.so.2 ]; then
    install -m 0644 .data/lib/libseccomp.so.2 /usr/local/lib/ && ldconfig
fi
# A cgroup delegated to the evaluator (docs/SANDBOX.md): our own cgroup holds other
# processes, so cgroup v2 would let it enable no controllers for per-job children.
if [ -z "${CUDA_AGENT_CGROUP:-}" ] && [ -w /sys/fs/cgroup/cgroup.subtree_control ]; then
    mkdir -p /sys/fs/cgroup/cuda-agent && echo "+memory +pids" > /sys/fs/cgroup/cgroup.subtree_control \
        && export CUDA_AGENT_CGROUP=/sys/fs/cgroup/cuda-agent
fi
echo "bwrap $(bwrap --version 2>&1) cgroup ${CUDA_AGENT_CGROUP:-none}" | tee "$OUT/sandbox.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.csv"
# Whatever else holds GPU memory before this call starts (an earlier call's leftovers on a warm machine).
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv | tee -a "$OUT/gpu.csv"
# Tables are per GPU model: the device tool may lend an H100 for an H200 (baselines_h100/, baselines_h200/).
GPU_SLUG=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|a100|b200|l40s?' | tr 'A-Z' 'a-z')
GPU_SLUG=${GPU_SLUG:-gpu}
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.csv"

part=${1:-tests}
shift || true  # the rest goes to pytest (tests, redteam), e.g. -k "illegal or profiler"
case "$part" in
integrations)
    # The RL stacks (tests/gpu/test_gpu_integrations.py): the whole carried wheel set, first on the path (its packages
    # are ones the machine lacks; first, so a carried version wins over anything older the image may gain).
    ls .whl/trl-*.whl .whl/openenv-*.whl >/dev/null 2>&1 || { echo "carry .whl with trl and openenv (see the top)" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "the carried wheels did not install" >&2; exit 2; }
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    python3 -c "import trl, transformers, datasets, openenv, fastapi, fastmcp, uvicorn, pyarrow, fsspec; print('trl', trl.__version__, \
'transformers', transformers.__version__, 'datasets', datasets.__version__, 'openenv', openenv.__version__, 'fastapi', \
fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pyarrow', pyarrow.__version__, 'fsspec', fsspec.__version__)" \
        2>&1 | tee -a "$OUT/gpu.csv"
    # The image's versions of what the carried packages ask for by name only (benchmarks/wheels_check.py -v).
    python3 -m pip list 2>/dev/null | grep -iE "^(typing.extensions|anyio|attrs|certifi|rich|httpx|pyarrow|fsspec|huggingface.hub|accelerate|transformers) " \
        | tr -s ' ' | tee -a "$OUT/gpu.csv"
    python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 600 -rf tests/gpu/test_gpu_integrations.py "$@" 2>&1 \
        | tee "$OUT/gpu_integrations.log"
    ;;
vs_release)
    # Side by side with the CUDA Agent release's scripts (carry .data/ca_release/agent_workdir: a copy of
    # the release's agent_workdir/, e.g. `git archive HEAD agent_workdir` of its repository).
    python3 experiments/vs_release.py --release .data/ca_release/agent_workdir --repeats ${VS_REPEATS:-10} \
        --out "$OUT/vs_release.jsonl" "$@" 2>&1 | tee "$OUT/vs_release.log" | tail -12
    ;;
release_stability)
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_timing.py 2>&1 | tee "$OUT/timing_tests.log" | tail -3
    python3 experiments/vs_release.py --release .data/ca_release/agent_workdir --repeats ${VS_REPEATS:-10} --gap 3 \
        --no-cold --release-for axpby cuda_gelu --out "$OUT/vs_release.jsonl" "$@" 2>&1 | tee "$OUT/vs_release.log" \
        | grep -v '^{'
    ;;
trust_suite)
    # The trust checks in one call: the integrity and timing tests, the GPU red-team cases, then the
    # legitimate solutions (KernelBench's and the examples) for false positives; logs kept as they go.
    python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_gpu_integrity.py tests/gpu/test_gpu_timing.py \
        2>&1 | tee "$OUT/integrity_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    CUDA_AGENT_GPU_REPORT=$OUT/gpu_records_redteam.jsonl python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        --timeout 300 -rf "$@" tests/redteam 2>&1 | tee "$OUT/gpu_redteam.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    CUDA_AGENT_GPU_REPORT=$OUT/gpu_records_tests.jsonl python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        --timeout 300 -rf tests/gpu/test_gpu_eval.py -k "kernelbench_solution or examples" 2>&1 \
        | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    ;;
outside_reads)
    # The outside reads on the GPU: the timing and integrity tests, the red team's v3 cases and the timing-path cases,
    # the legitimate solutions (false positives, rewards), then the brackets' agreement on them.
    python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_gpu_timing.py tests/gpu/test_gpu_integrity.py \
        tests/evaluate/test_outside_gpu.py tests/gpu/test_gpu_quiet.py 2>&1 | tee "$OUT/timing_tests.log" \
        | grep -E "^(FAILED|ERROR)|passed|failed"
    python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 -rf tests/redteam/test_redteam_gpu.py \
        -k "${REDTEAM_K:-elapsed-swapped or type_entry or scaled-samples or secrets-from or event-timer or deferred-half or phase-detection or forge-reply or computed-ahead or lingering}" \
        2>&1 | tee "$OUT/gpu_redteam.log" | grep -E "^(FAILED|ERROR|XPASS)|passed|failed|xfail"
    [ "${AGREEMENT_ONLY:-}" = none ] && exit 0  # the tests and the red team only
    python3 benchmarks/clock_agreement.py --device cuda --kernelbench .data/kernelbench/kernelbench.jsonl \
        --only ${AGREEMENT_ONLY:-cuda_gelu cuda_row_softmax cuda_bias_scale_tanh level1_19 level1_21 level1_47 level2_40 level2_76} \
        --repeats ${AGREEMENT_REPEATS:-1} --out "$OUT/clock_agreement.jsonl" 2>&1 | tee "$OUT/clock_agreement.log" \
        | grep -v "^USDT"
    ;;
outside_clock)
    # The evaluator's own clock: its GPU tests, the red team's timing cases (CLOCK_REDTEAM=1; REDTEAM_K), the CUDA
    # Agent release's axpby (carry .data/ca_release/agent_workdir) and the examples CLOCK_EXAMPLE_REPEATS times each,
    # then every other honest solution CLOCK_REPEATS times (CLOCK_ONLY: names), each with its Markdown table.
    # CLOCK_EXAMPLES: which examples; CLOCK_ARGS: more options for the examples' run (e.g. --region-memory-share 0.25).
    if [ "${CLOCK_TESTS:-1}" != 0 ]; then
        python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/evaluate/test_outside_gpu.py tests/evaluate/test_regions.py \
            2>&1 | tee "$OUT/timing_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    fi
    if [ "${CLOCK_REDTEAM:-0}" != 0 ]; then
        python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 -rf tests/redteam/test_redteam_gpu.py \
            -k "${REDTEAM_K:-true_cost}" 2>&1 | tee "$OUT/gpu_redteam.log" \
            | grep -E "^(FAILED|ERROR|XPASS)|passed|failed|xfail|^status|^ *candidate:|timed by|honest: |^regions"
    fi
    examples=${CLOCK_EXAMPLES:-axpby cuda_gelu cuda_row_softmax cuda_bias_scale_tanh}
    if [ "${CLOCK_EXAMPLE_REPEATS:-10}" != 0 ]; then
        python3 benchmarks/clock_agreement.py --device cuda --release .data/ca_release/agent_workdir --only $examples \
            --repeats "${CLOCK_EXAMPLE_REPEATS:-10}" ${CLOCK_ARGS:-} --out "$OUT/outside_clock_examples.jsonl" 2>&1 \
            | tee "$OUT/outside_clock_examples.log" | grep -v "^USDT"
    fi
    if [ "${CLOCK_REPEATS:-1}" != 0 ]; then
        python3 benchmarks/clock_agreement.py --device cuda --kernelbench .data/kernelbench/kernelbench.jsonl \
            --repeats "${CLOCK_REPEATS:-1}" --skip $examples ${CLOCK_ONLY:+--only $CLOCK_ONLY} \
            --out "$OUT/outside_clock.jsonl" 2>&1 | tee "$OUT/outside_clock.log" | grep -v "^USDT"
    fi
    ;;
agreement)
    # The red team's region cases (about 170 s on the H200; AGREEMENT_REDTEAM=0 leaves them out), then the
    # brackets against the reported regions for every honest solution (benchmarks/clock_agreement.py; --only NAMES).
    if [ "${AGREEMENT_REDTEAM:-1}" != 0 ]; then
        python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 -rf tests/redteam/test_redteam_gpu.py \
            -k "elapsed-swapped or type_entry or scaled-samples or secrets-from" 2>&1 | tee "$OUT/gpu_redteam_v3.log" \
            | grep -E "^(FAILED|ERROR|XPASS)|passed|failed|xfail"
    fi
    python3 benchmarks/clock_agreement.py --device cuda --kernelbench .data/kernelbench/kernelbench.jsonl \
        --out "$OUT/clock_agreement.jsonl" "$@" 2>&1 | tee "$OUT/clock_agreement.log" | grep -v "^USDT"
    ;;
clock_rate)
    # Do the host's clocks (the brackets' CLOCK_REALTIME) and the GPU's event timer run at one rate? (~15 s)
    python3 experiments/probes/clock_rate_probe.py --out "$OUT/clock_rate.json" "$@" 2>&1 | tee "$OUT/clock_rate.log"
    ;;
quiet)
    # Can a process tell from outside that another process's context runs GPU work (time-slicing)?
    python3 experiments/probes/gpu_quiet_probe.py ${QUIET_MODES:-} 2>&1 | tee "$OUT/gpu_quiet_probe.log"
    ;;
vmm)
    # Can another sandboxed process read a candidate's GPU output (VMM descriptors, legacy IPC)?
    python3 experiments/probes/vmm_share_probe.py 2>&1 | tee "$OUT/vmm_share_probe.log"
    ;;
false_positives)
    # The legitimate solutions alone (KernelBench's and the examples): false positives, and whether the largest
    # tasks fit the card beside the reference; then the evaluation's memory per process and stage on level 1 / 19.
    CUDA_AGENT_GPU_REPORT=$OUT/gpu_records_legit.jsonl python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        --timeout 300 -rf tests/gpu/test_gpu_eval.py -k "kernelbench_solution or examples" "$@" 2>&1 \
        | tee "$OUT/gpu_legit.log" | grep -E "^(FAILED|ERROR)|passed|failed|^task|status:|rerun|run again"
    python3 benchmarks/eval_memory.py --device cuda --kernelbench .data/kernelbench/kernelbench.jsonl \
        --every 0.2 --out "$OUT/eval_memory_cuda.json" 2>&1 | tee "$OUT/eval_memory.log" | tail -16
    ;;
integrity_reads)
    # The random in-round integrity read's cost: seconds per evaluation and the candidate's measured time.
    # DEFENCE=rerun: the timed call run again bit for bit instead.
    python3 experiments/integrity_reads.py --device cuda --examples ${SPEED_EXAMPLES:-cuda_gelu cuda_row_softmax} \
        --defence ${DEFENCE:-read} --repeats ${VS_REPEATS:-5} --out "$OUT/defence_${DEFENCE:-read}.json" 2>&1 \
        | tee "$OUT/defence_${DEFENCE:-read}.log" | tail -8
    ;;
tests|redteam)
    # One device call each: the whole GPU suite has taken close to the 10-minute limit of a call.
    where=tests/gpu
    [ "$part" = redteam ] && where=tests/redteam
    if [ "$part" = tests ]; then
        # The sandbox on real cgroups and GPU device nodes (CPU and GPU cases alike).
        python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfs tests/sandbox 2>&1 | tee "$OUT/sandbox_tests.log" | tail -6
    fi
    selected=("$where")
    # A test file or folder among the arguments narrows the call to it (else the whole suite runs, a call's
    # ten minutes and more, past the device tool's limit).
    narrowed=() rest=()
    for arg in "$@"; do
        if [[ "$arg" == tests/* && -e "${arg%%::*}" ]]; then narrowed+=("$arg"); else rest+=("$arg"); fi
    done
    if [ ${#narrowed[@]} -gt 0 ]; then selected=("${narrowed[@]}"); set -- "${rest[@]}"; fi
    if [ -n "${SHARD:-}" ]; then
        # SHARD=i/n: every n-th test from the i-th, in collection order (the whole GPU red team is over one call).
        mapfile -t selected < <(python3 -m pytest -m gpu -q -p no:cacheprovider --collect-only "$@" "$where" 2>/dev/null \
            | grep "::" | awk -v i="${SHARD%/*}" -v n="${SHARD#*/}" '(NR - i) % n == 0')
        [ ${#selected[@]} -gt 0 ] || { echo "SHARD=$SHARD selects no test" >&2; exit 2; }
        echo "shard $SHARD: ${#selected[@]} tests" | tee -a "$OUT/gpu.csv"
    fi
    CUDA_AGENT_GPU_REPORT=$OUT/gpu_records_$part.jsonl python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        --timeout 300 -rf "$@" "${selected[@]}" 2>&1 | tee "$OUT/gpu_$part.log" | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|status:|rule"
    ;;
speed|bench)
    python3 benchmarks/eval_speed.py --device cuda --examples ${SPEED_EXAMPLES:-cuda_gelu cuda_row_softmax} --repeats 5 --remeasured ${SPEED_REMEASURED:-5} \
        --out "$OUT/eval_speed.json" 2>&1 | tee "$OUT/eval_speed.log" | tail -8
    ;;&
guard|bench)
    python3 benchmarks/guard_overhead.py --device cuda --examples cuda_gelu --repeats ${GUARD_REPEATS:-3} \
        --out "$OUT/guard_overhead.json" 2>&1 | tee "$OUT/guard_overhead.log" | tail -3
    ;;&
precision|bench)
    python3 benchmarks/precision_calibration.py --device cuda --out "$OUT/precision_calibration.json" 2>&1 | tail -6
    ;;
speed|guard) ;;
train_tests)
    python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 300 tests/gpu/test_gpu_train.py "$@" 2>&1 | tee "$OUT/train_tests.log" | tail -40
    ;;
train_throughput)
    name=${THROUGHPUT_NAME:-train_throughput}
    python3 benchmarks/train_throughput.py --out "$OUT/$name" ${THROUGHPUT_ARGS:-} 2>&1 \
        | tee "$OUT/$name.log" | grep -v "^ \|^{\|^}" | tail -30
    ;;
train_demo)
    python3 -c "import transformers, tokenizers; print('transformers', transformers.__version__)" | tee -a "$OUT/gpu.csv"
    python3 -m cuda_agent.cli train demo --device cuda --out "$OUT/train_demo" --steps "${TRAIN_STEPS:-30}" 2>&1 \
        | tee "$OUT/train_demo.log" | grep -v "^ " | tail -40
    rm -rf "$OUT/train_demo/checkpoint" "$OUT/train_demo/menu"  # weights and sources: not worth the transfer
    ;;
verdict_rate)
    # An honest GPU evaluation's verdicts with most of the host's cores busy, as on an RL node that builds and
    # tokenises beside its evaluations (VERDICT_BUSY: busy processes per pass; VERDICT_REPEATS evaluations each)
    cores=$(nproc)
    python3 benchmarks/verdict_rate.py --device cuda --busy ${VERDICT_BUSY:-0 $((cores / 2)) $((cores - 2))} \
        --repeats "${VERDICT_REPEATS:-3}" ${VERDICT_ARGS:-} --out "$OUT/verdict_rate_gpu.json" 2>&1 | tail -30
    ;;
triton)
    python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$OUT/gpu.csv"
    CUDA_AGENT_TRITON_REPORT=$OUT CUDA_AGENT_TRITON_BUDGET_S=${TRITON_BUDGET_S:-280} \
        python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 600 -rf "$@" tests/gpu/test_gpu_triton.py 2>&1 \
        | tee "$OUT/gpu_triton.log" | grep -vE "^\s*$" | tail -150
    ;;
counters)
    # Hardware counters: the GPU tests, with each case's raw ncu CSV kept as a fixture
    CUDA_AGENT_COUNTERS_FIXTURES=$OUT/counters_fixtures CUDA_AGENT_GPU_REPORT=$OUT/gpu_records_counters.jsonl \
        python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 600 -rf "$@" tests/gpu/test_gpu_counters.py 2>&1 \
        | tee "$OUT/gpu_counters.log" | grep -vE "^\s*$" | tail -150
    ;;
service)
    # The evaluation service's local backend against evaluate_many (SERVICE_REPEATS jobs per example)
    python3 benchmarks/service_throughput.py --device cuda --repeats "${SERVICE_REPEATS:-6}" \
        --out "$OUT/service_throughput.json" 2>&1 | tail -30
    ;;
rl_workload)
    # Each tree gets RL_SECONDS (its stream stops submitting at 60% of it, the rewards alone at 100%; what is
    # in flight then still finishes, hence the margin) so that both fit the device tool's 10-minute call. A
    # new task costs a reference start, torch.compile and its baselines (~15-25 s), so few tasks with the
    # baseline tree; all 16 in a call of their own: RL_TASKS=16 RL_SECONDS=480 without .data/prev/src.
    # RL_TREE=this or RL_TREE=prev runs one tree alone (prev: the carried .data/prev/src, one slot, no second
    # pass), for streams too long for both trees in one call; the two calls' JSON are then set side by side.
    baseline=""; [ -d .data/prev/src ] && [ "${RL_TREE:-both}" = both ] && baseline="--baseline-src .data/prev/src"
    if [ -n "$baseline" ]; then tasks=${RL_TASKS:-4} secs=${RL_SECONDS:-200}; else tasks=${RL_TASKS:-8} secs=${RL_SECONDS:-450}; fi
    tree=$PWD/src per_gpu=${RL_PER_GPU:-2} extra=() name=rl_workload
    if [ "${RL_TREE:-both}" = prev ]; then
        [ -d .data/prev/src ] || { echo "RL_TREE=prev: carry .data/prev/src" >&2; exit 2; }
        tree=$PWD/.data/prev/src per_gpu=1 extra=(--no-alone) name=rl_workload.baseline
    fi
    if [ "${RL_TREE:-both}" = side ]; then
        # Both trees in one call at once, each on its own GPU and half the host's cores (kind nvidia-h200-x2: 16 of
        # 32 each, as the one-GPU machine has): the baseline (the carried .data/prev/src, one slot, no pass alone)
        # on GPU 0, this tree on GPU 1. The comparison wants the two side by side in one run; one after the other they
        # do not fit a call. This tree sizes its build pool from the cores it may use (8 workers, as on the one-GPU
        # machine); the baseline's from the host's count (16). The host CPU-s per evaluation (/proc/stat) counts
        # both streams: read that one from calls of one tree.
        [ -d .data/prev/src ] || { echo "RL_TREE=side: carry .data/prev/src" >&2; exit 2; }
        [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "RL_TREE=side: needs two GPUs (kind nvidia-h200-x2)" >&2; exit 2; }
        half=$(( $(nproc) / 2 ))
        common=(--device cuda --kernelbench .data/kernelbench/kernelbench.jsonl --tasks "${RL_TASKS:-8}"
                --concurrency "${RL_CONCURRENCY:-16}" --max-seconds "${RL_SECONDS:-450}" ${RL_WARMUP:+--warmup "$RL_WARMUP"})
        PYTHONPATH=$PWD/.data/prev/src taskset -c 0-$(( half - 1 )) python3 benchmarks/rl_workload.py "${common[@]}" \
            --gpu 0 --per-gpu 1 --no-alone --out "$OUT/rl_workload.baseline.json" > "$OUT/rl_workload.baseline.log" 2>&1 &
        PYTHONPATH=$tree taskset -c $half-$(( 2 * half - 1 )) python3 benchmarks/rl_workload.py "${common[@]}" \
            --gpu 1 --per-gpu "${RL_PER_GPU:-8}" --out "$OUT/rl_workload.json" "$@" > "$OUT/rl_workload.log" 2>&1 &
        wait
        grep -v "^USDT" "$OUT/rl_workload.baseline.log" | tail -30; grep -v "^USDT" "$OUT/rl_workload.log" | tail -40
        exit 0
    fi
    # RL_ALONE_OF=ROWS.jsonl (an earlier call's stream, e.g. under benchmarks/results): no stream, only the pass
    # alone over its candidates, compared with its rewards (the stream and the whole pass alone do not fit one call).
    if [ -n "${RL_ALONE_OF:-}" ]; then baseline="" extra=(--alone-of "$RL_ALONE_OF") name=rl_workload.alone; fi
    PYTHONPATH=$tree python3 benchmarks/rl_workload.py --device cuda --kernelbench .data/kernelbench/kernelbench.jsonl \
        --tasks "$tasks" --concurrency "${RL_CONCURRENCY:-8}" --max-seconds "$secs" --per-gpu "$per_gpu" \
        ${RL_WARMUP:+--warmup "$RL_WARMUP"} ${RL_PAUSE:+--pause-neighbours} ${RL_NO_PAUSE:+--no-pause} ${RL_REFERENCE_GIB:+--reference-gib "$RL_REFERENCE_GIB"} ${RL_APART:+--apart "$RL_APART"} --out "$OUT/$name.json" $baseline "${extra[@]}" "$@" 2>&1 \
        | tee "$OUT/$name.log" | grep -v "^USDT" | tail -60
    ;;
edit_to_reward)
    # EDIT_TREE=this: this tree only and no device-lock test after it (~140 s for the two examples), to share a call.
    baseline=""; [ -d .data/prev/src ] && [ "${EDIT_TREE:-both}" != this ] && baseline="--baseline-src .data/prev/src"
    python3 benchmarks/edit_to_reward.py --device cuda --examples ${SPEED_EXAMPLES:-cuda_gelu cuda_row_softmax} \
        --edits "${EDITS:-3}" --out "$OUT/edit_to_reward.json" $baseline "$@" 2>&1 | tee "$OUT/edit_to_reward.log" \
        | grep -v "^USDT" | tail -30
    [ "${EDIT_TREE:-both}" = this ] && exit 0
    python3 -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 -rf tests/gpu/test_gpu_device_lock.py 2>&1 \
        | tee "$OUT/gpu_device_lock.log" | tail -15
    ;;
overhead)
    [ -d .data/prev/src ] || { echo "carry .data/prev/src (the tree to compare with)" >&2; exit 2; }
    # A run "N-this+all": this tree under Policy(outside_inputs="all") (eval_speed's --outside-inputs).
    for run in ${OVERHEAD_RUNS:-1-prev 2-this 3-prev 4-this}; do
        label=${run#*-} tree=${label%%+*} path=$PWD/src; [ "$tree" = prev ] && path=$PWD/.data/prev/src
        policy=(); [ "$tree" = "$label" ] || policy=(--outside-inputs "${label#*+}")
        rm -rf "$CUDA_AGENT_CACHE"
        PYTHONPATH=$path python3 benchmarks/eval_speed.py --device cuda --examples ${SPEED_EXAMPLES:-cuda_gelu} \
            --repeats ${VS_REPEATS:-3} --remeasured 0 "${policy[@]}" --out "$OUT/overhead_$run.json" 2>&1 \
            | tee -a "$OUT/overhead.log" | tail -4
    done
    ;;
region_cost)
    # Where a warm re-evaluation's seconds go, by wall clock around each step (experiments/probes/region_cost_probe.py),
    # the candidate's stops polled every 1 ms and every 0.1 ms in turn.
    python3 experiments/probes/region_cost_probe.py --device cuda --kernelbench .data/kernelbench/kernelbench.jsonl \
        --examples ${SPEED_EXAMPLES:-cuda_gelu} --evaluations ${EVALUATIONS:-7} --pause-poll-ms ${PAUSE_POLLS:-1 0.1} \
        --out "$OUT/region_cost.jsonl" "$@" 2>&1 | tee "$OUT/region_cost.log" | grep -v "^USDT"
    ;;
verify_costs)
    # The steps of one check outside the evaluator (experiments/verify_costs.py), with the reference's default
    # allocator and with the candidate's (expandable segments).
    solutions=${PROFILE_SOLUTIONS:-level1_20 level1_5 level1_22 level1_23}
    python3 experiments/verify_costs.py --kernelbench .data/kernelbench/kernelbench.jsonl $solutions \
        --out "$OUT/verify_costs.json" 2>&1 | tee "$OUT/verify_costs.log"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 experiments/verify_costs.py \
        --kernelbench .data/kernelbench/kernelbench.jsonl $solutions --out "$OUT/verify_costs_expandable.json" 2>&1 \
        | tee "$OUT/verify_costs_expandable.log"
    ;;
eval_profile)
    # Where one evaluation's seconds go, request by request, for KernelBench solutions (PROFILE_SOLUTIONS, folders
    # of benchmarks/solutions_kb; PROFILE_EVALUATIONS each on one evaluator, the first fills the caches).
    for solution in ${PROFILE_SOLUTIONS:-level1_20 level1_5}; do
        python3 benchmarks/eval_profile.py --device cuda --solution "$solution" --kernelbench .data/kernelbench/kernelbench.jsonl \
            --evaluations "${PROFILE_EVALUATIONS:-3}" --gap 1 --out "$OUT/eval_profile_$solution.json" 2>&1 \
            | grep -v "^USDT" | tee "$OUT/eval_profile_$solution.log" | tail -90
    done
    ;;
profile)
    # Where a warm re-evaluation's seconds go: eval_speed under cProfile (the evaluator's thread), this tree and
    # a carried .data/prev/src, then each profile's heaviest entries by cumulative time.
    for tree in this prev; do
        path=$PWD/src; [ "$tree" = prev ] && path=$PWD/.data/prev/src
        [ -d "$path" ] || continue
        rm -rf "$CUDA_AGENT_CACHE"
        PYTHONPATH=$path python3 -m cProfile -o "$OUT/profile_$tree.prof" benchmarks/eval_speed.py --device cuda \
            --examples ${SPEED_EXAMPLES:-cuda_gelu} --repeats ${VS_REPEATS:-3} --remeasured 0 \
            --out "$OUT/profile_$tree.json" 2>&1 | tail -3
        python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(90)" \
            "$OUT/profile_$tree.prof" > "$OUT/profile_$tree.txt" 2>&1
    done
    ;;
bracket_excess)
    # Each evaluation's region brackets against their limit (experiments/probes/region_excess_probe.py), for this
    # tree and carried ones (EXCESS_TREES: "this" or the name of a carried .data/NAME/src), in turn.
    # "this+pause" / "this+resume": this tree with every worker stop (or resume) delayed (the probe's --delay).
    # EXCESS_ARGS go to the probe (e.g. "--outside-inputs all").
    for label in ${EXCESS_TREES:-this}; do
        tree=${label%%+*}; delay=(); [ "$tree" = "$label" ] || delay=(--delay "${label#*+}")
        path=$PWD/src; [ "$tree" = this ] || path=$PWD/.data/$tree/src
        PYTHONPATH=$path python3 experiments/probes/region_excess_probe.py --examples ${SPEED_EXAMPLES:-cuda_gelu} \
            --kernelbench .data/kernelbench/kernelbench.jsonl "${delay[@]}" \
            --evaluations ${EXCESS_EVALUATIONS:-6} --label "$label" --out "$OUT/region_excess.jsonl" ${EXCESS_ARGS:-} 2>&1 \
            | grep -v "^USDT\|UserWarning\|_warn_once" | tee -a "$OUT/region_excess.log"
    done
    ;;
compile_noise)
    # torch.compile's baseline measured again and again: one process, with gaps, fresh compilations.
    python3 experiments/compile_noise_probe.py --out "$OUT/compile_noise.jsonl" "$@" 2>&1 \
        | tee "$OUT/compile_noise.log" | grep -v '^{' | tail -20
    ;;
region_end_variants)
    # The end of the timed region, variant by variant (experiments/timing_stability.py).
    python3 experiments/timing_stability.py --examples ${SPEED_EXAMPLES:-cuda_gelu cuda_row_softmax} \
        --repeats ${VS_REPEATS:-6} --out "$OUT/stability.jsonl" "$@" 2>&1 | tee "$OUT/stability.log" | grep -v "^ "
    ;;
drift)
    python3 experiments/timing_drift.py --examples ${SPEED_EXAMPLES:-cuda_gelu cuda_row_softmax} \
        --evaluations ${DRIFT_EVALUATIONS:-6} --out "$OUT/drift" 2>&1 | tee "$OUT/drift.log" | tail -4
    ;;
synth)
    # Resumable across device calls: carry .data/synth_h200 (the last call's $OUT/synth_h200, fetched).
    mkdir -p .data/synth_h200
    timeout "${SYNTH_SECONDS:-480}" python3 -m cuda_agent.cli synth --n "${SYNTH_N:-300}" --out .data/synth_h200 \
        --device cuda --workers "${SYNTH_WORKERS:-8}" --kernelbench .data/kernelbench/kernelbench.jsonl --quiet \
        2>&1 | tail -5 | tee "$OUT/synth.log"
    python3 -c "from cuda_agent.synth.report import finish; print(finish('.data/synth_h200')['filters'])" | tee -a "$OUT/synth.log"
    # The device tool returns at most 8 files: the state to resume from; report and plots are remade
    # locally with `python -c "from cuda_agent.synth.report import finish; finish('DIR')"`.
    mkdir -p "$OUT/synth_h200" && cp .data/synth_h200/{run.json,candidates.jsonl,tasks.jsonl} "$OUT/synth_h200/"
    ;;
baselines)
    # The table is written straight into $OUT, so that a call killed at its time limit still
    # returns every finished row; it resumes from a carried .data/baselines_<gpu>/baselines.jsonl
    # (<gpu>: h100, h200, ... as nvidia-smi names the card lent).
    table=baselines_$GPU_SLUG
    mkdir -p "$OUT/$table"
    [ -f ".data/$table/baselines.jsonl" ] && cp ".data/$table/baselines.jsonl" "$OUT/$table/"
    python3 -m cuda_agent.cli baselines .data/kernelbench/kernelbench.jsonl --level 1 --level 2 --level 3 \
        --out "$OUT/$table/baselines.jsonl" --device cuda --deadline-s "${BASELINES_SECONDS:-420}" \
        --per-gpu "${BASELINES_PER_GPU:-3}" --published .data/kernelbench 2>&1 | tee "$OUT/baselines.log" | tail -40
    ;;
bench_own)
    # `cuda-agent bench` over the project's own KernelBench solutions (tests/gpu/kernelbench_solutions),
    # with the committed H200 baselines table; then the baselines table's retries (rows whose
    # measurement could not finish), as in `baselines`. Only the run's state comes back (the device
    # tool returns few files): remake the reports with `cuda-agent report DIR`.
    mkdir -p "$OUT/bench_own" "$OUT/baselines_h200"
    cp benchmarks/results/baselines_h200/baselines.jsonl "$OUT/baselines_h200/"
    python3 -m cuda_agent.cli bench .data/kernelbench/kernelbench.jsonl --level 1 --level 2 --level 3 \
        --solutions tests/gpu/kernelbench_solutions \
        --out "$OUT/bench_own" --device cuda --baselines "$OUT/baselines_h200/baselines.jsonl" 2>&1 \
        | tee "$OUT/bench.log" | tail -12
    rm -f "$OUT"/bench_own/*.{png,csv,md} "$OUT/bench_own/metrics.json"
    python3 -m cuda_agent.cli baselines .data/kernelbench/kernelbench.jsonl --level 1 --level 2 --level 3 \
        --out "$OUT/baselines_h200/baselines.jsonl" --device cuda --deadline-s "${BASELINES_SECONDS:-300}" \
        --per-gpu "${BASELINES_PER_GPU:-2}" --quiet 2>&1 | tee "$OUT/baselines.log" | grep -E "not timed|measure again" 
    rm -f "$OUT/baselines_h200/baselines.md"
    ;;
*)
    echo "usage: $0 integrations|vs_release|release_stability|trust_suite|outside_reads|outside_clock|agreement|clock_rate|quiet|vmm|false_positives|integrity_reads|tests|redteam|speed|bench|guard|precision|train_tests|train_throughput|train_demo|counters|service|rl_workload|edit_to_reward|overhead|region_cost|verify_costs|eval_profile|profile|bracket_excess|compile_noise|region_end_variants|drift|synth|baselines|bench_own|verdict_rate|triton [pytest args]" >&2
    exit 2
    ;;
esac
