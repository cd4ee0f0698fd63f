"""Isolation between evaluations: what one candidate does cannot change another's result, and nothing of the
evaluator's reaches a candidate except its task and inputs (docs/SECURITY.md, "Isolation between
evaluations").

Each route is an attacker and then an honest victim through the same cache, evaluator or service; the
victim must come out as on a clean cache. Compiled modules embed their build directory (``__FILE__`` in
torch's checks), so "the same module" is checked by what it defines and by the attacker's marker, not byte
for byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.build import build
from cuda_agent.build.probe import probe_candidate
from cuda_agent.candidates import Candidate, Extension
from cuda_agent.candidates.candidate import FIXED_FILES, fixed_file
from cuda_agent.evaluate import Timeouts
from cuda_agent.sandbox import SandboxUnavailable, make_sandbox

pytestmark = pytest.mark.slow

try:
    SANDBOX = make_sandbox("bwrap")
except SandboxUnavailable as exc:
    pytest.skip(f"bwrap sandbox unavailable: {exc}", allow_module_level=True)

MARKER = "ISO-ATTACKER-MARKER-7f3a"
SOLUTION = Path(__file__).resolve().parents[2] / "examples" / "cpu_swish" / "solution"
KERNEL = "kernels/scaled_swish.cpp"
SECRETS = {"OPENAI_API_KEY": "sk-iso-planted-openai-91c2", "HF_TOKEN": "hf_iso_planted_55e1",
           "AWS_SECRET_ACCESS_KEY": "iso-planted-aws-3b7d", "MY_SECRET_TOKEN": "iso-planted-custom-a9f0",
           "CUDA_AGENT_SERVICE_TOKEN": "iso-planted-service-0c4e"}


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """(attacked, clean): two fresh caches. No precompiled header, so each costs the glue's two units
    rather than its 500 MB header (the header is published like any object)."""
    previous = os.environ.get("CUDA_AGENT_BUILD_PCH")
    os.environ["CUDA_AGENT_BUILD_PCH"] = "0"
    yield tmp_path_factory.mktemp("attacked"), tmp_path_factory.mktemp("clean")
    if previous is None:
        os.environ.pop("CUDA_AGENT_BUILD_PCH", None)
    else:
        os.environ["CUDA_AGENT_BUILD_PCH"] = previous


def workspace(kernels: dict[str, str], binding: str | None = None, origin: str = "test") -> Candidate:
    """The example's solution with ``kernels`` (path -> text) in place of its kernel."""
    honest = load_candidate(SOLUTION)
    sources = {p: t for p, t in honest.extensions[0].sources.items() if p != KERNEL} | kernels
    if binding is not None:
        sources["kernels/scaled_swish_binding.cpp"] = binding
    return Candidate(model_new=honest.model_new, kind="workspace", origin=origin,
                     extensions=(Extension(name="cuda_extension", sources=sources),))


def kernel_text(round_: int) -> str:
    """The honest kernel, made a new unit key per round (so each round races a first compile)."""
    return (SOLUTION / KERNEL).read_text() + f"\n// round {round_}\n"


def poisoner(round_: int) -> str:
    """A root file whose object path collided with kernels/scaled_swish.cpp's (``/`` -> ``__``): same
    launcher symbol, wrong result, and a marker."""
    return (f'extern "C" const char iso_marker[] = "{MARKER}";\n#include <cstdint>\n'
            'extern "C" void scaled_swish_launch(const float* x, float* y, int64_t n, float scale) {\n'
            '  for (int64_t i = 0; i < n; ++i) y[i] = 0.0f;\n}\n' f"// round {round_}\n")


def defined_symbols(module: str) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", module], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip())


def test_a_race_on_the_probe_cannot_widen_the_symbol_audit(caches):
    """Before the probe is ever built, attackers race its kernel's object with one that starts threads;
    the audit's allowlist then read on that cache is the clean cache's."""
    attacked, clean = caches
    probe = probe_candidate("cpu")
    sources = probe.extensions[0].sources
    evil = ('#include <pthread.h>\n#include <cstdint>\nstatic void* idle(void*) { return nullptr; }\n'
            'extern "C" void probe_launch(const float* x, float* y, int64_t n) {\n'
            '  pthread_t t; pthread_create(&t, nullptr, idle, nullptr); pthread_join(t, nullptr);\n'
            '  for (int64_t i = 0; i < n; ++i) y[i] = x[i];\n}\n')
    attacker = Candidate(model_new=probe.model_new, kind="workspace", origin="attacker",
                         extensions=(Extension(name="cuda_extension",
                                               sources=dict(sources) | {"kernels__probe.cpp": evil}),))
    threads = [threading.Thread(target=build, args=(attacker, "cpu"), kwargs={"cache_dir": attacked, "sandbox": SANDBOX})
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    imports = Evaluator("cpu", cache_dir=attacked, sandbox=SANDBOX).toolchain_imports()
    assert "pthread_create" not in imports
    assert imports == Evaluator("cpu", cache_dir=clean, sandbox=SANDBOX).toolchain_imports()
    # The probe's namespace holds only the probe's units.
    units = {json.loads(r.read_text())["unit"] for r in (attacked / "probe" / "objects").glob("*/*/record.json")}
    assert set(probe.extensions[0].compile_units) <= units <= set(sources) | {"cuda_agent_pch.h"}, units
    # ... and no candidate key of the attacked cache was the probe's source of truth.
    assert not any(json.loads(r.read_text())["unit"] == "kernels__probe.cpp"
                   for r in (attacked / "probe").glob("**/record.json"))


def test_colliding_object_paths_cannot_poison_an_honest_unit(caches):
    """The issue's race: a root ``kernels__scaled_swish.cpp`` beside ``kernels/scaled_swish.cpp``, two
    attackers at once per round; then an honest candidate with that kernel through the same cache links
    what it links on a clean cache, reusing the unit the attackers compiled."""
    attacked, clean = caches
    for round_ in range(3):
        attacker = workspace({KERNEL: kernel_text(round_), "kernels__scaled_swish.cpp": poisoner(round_)})
        threads = [threading.Thread(target=build, args=(attacker, "cpu"),
                                    kwargs={"cache_dir": attacked, "sandbox": SANDBOX}) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        victim = workspace({KERNEL: kernel_text(round_)})
        after = build(victim, "cpu", cache_dir=attacked, sandbox=SANDBOX)
        fresh = build(victim, "cpu", cache_dir=clean, sandbox=SANDBOX)
        assert after.ok and fresh.ok, (after.error, fresh.error)
        assert [u["reused"] for u in after.units if u["unit"] == KERNEL] == [True]  # the attackers' compile
        module = after.modules["cuda_extension"]
        assert MARKER.encode() not in Path(module).read_bytes()
        assert defined_symbols(module) == defined_symbols(fresh.modules["cuda_extension"])
    # No entry of the shared cache holds the attacker's code under a key of another unit.
    for record in attacked.glob("objects/*/*/record.json"):
        data = json.loads(record.read_text())
        has_marker = MARKER.encode() in (record.parent / "object").read_bytes()
        assert has_marker == (data["unit"] == "kernels__scaled_swish.cpp"), data["unit"]


def _planted_files() -> list[Path]:
    return [Path.home() / f".iso-planted-{uuid.uuid4().hex[:8]}",
            Path(__file__).resolve().parents[2] / f".iso-planted-{uuid.uuid4().hex[:8]}"]


def spy(planted: list[Path], escape: Path) -> Candidate:
    """An honest kernel whose model_new.py and C++ print every variable they can see and read the planted
    files, and which tries to write ``escape`` outside its job directory."""
    names = sorted(SECRETS)
    dump = ("import os as _os\nprint('SPY-PY-ENV', sorted(_os.environ.items()), flush=True)\n"
            f"for _p in {[str(p) for p in planted]!r}:\n"
            "    try:\n        print('SPY-READ', _p, open(_p).read(), flush=True)\n"
            "    except OSError as _e:\n        print('SPY-DENIED', _p, type(_e).__name__, flush=True)\n"
            f"try:\n    open({str(escape)!r}, 'w').write('escaped')\n    print('SPY-WROTE', flush=True)\n"
            "except OSError as _e:\n    print('SPY-WRITE-DENIED', type(_e).__name__, flush=True)\n")
    cpp = ("#include <cstdio>\n#include <cstdlib>\nnamespace {\nstruct Spy { Spy() {\n"
           f"  const char* names[] = {{{', '.join(json.dumps(n) for n in names)}, \"LANG\"}};\n"
           "  for (const char* n : names) { const char* v = std::getenv(n); "
           "std::printf(\"SPY-CPP-ENV %s=%s\\n\", n, v ? v : \"(unset)\"); }\n"
           "  std::fflush(stdout); } } spy;\n}\n")
    honest = workspace({KERNEL: (SOLUTION / KERNEL).read_text() + "\n" + cpp})
    model = honest.model_new.replace("import cuda_extension\n", "import cuda_extension\n" + dump, 1)
    return Candidate(model_new=model, kind="workspace", origin="spy", extensions=honest.extensions)


def test_an_evaluation_leaks_no_secret_file_or_write_and_the_victim_after_it_is_clean(caches, monkeypatch, tmp_path):
    """Through the attacked cache and one evaluator: a spy with planted secrets in the evaluator's
    environment and planted files outside its view, then the honest solution."""
    attacked, _ = caches
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LANG", "C.UTF-8")
    planted = _planted_files()
    escape_dir = Path.home() / f".iso-escape-{uuid.uuid4().hex[:8]}"
    escape_dir.mkdir()
    stages: list[str] = []
    try:
        for path in planted:
            path.write_text("ISO-PLANTED-FILE-CONTENT")
        evaluator = Evaluator("cpu", cache_dir=attacked, sandbox=SANDBOX, timeouts=Timeouts(check_s=120, load_s=300),
                              memory_limit=6 * 1024**3, on_stage=lambda stage, detail: stages.append(f"{stage} {detail}"))
        evaluator.policy = evaluator.policy.with_(static_checks=False)  # let the spy's code run
        task = load_task(SOLUTION.parent / "model.py")
        result = evaluator.verify(task, spy(planted, escape_dir / "x.txt"))
        record = json.dumps(result.to_dict())
        # The spy ran and printed (else nothing below would prove anything) ...
        assert "SPY-PY-ENV" in result.output and "SPY-CPP-ENV LANG=C.UTF-8" in result.output, result.summary()
        # ... and saw no secret, no planted file, and wrote nothing outside its job.
        for text in (record, result.output, "\n".join(stages), result.build.get("log", "") if result.build else ""):
            for value in SECRETS.values():
                assert value not in text
            assert "ISO-PLANTED-FILE-CONTENT" not in text
        for name in SECRETS:
            assert f"SPY-CPP-ENV {name}=(unset)" in result.output
        for path in planted:
            assert f"SPY-DENIED {path} FileNotFoundError" in result.output
        assert "SPY-WRITE-DENIED" in result.output and not list(escape_dir.iterdir())
        assert result.status == "correct", result.summary()
        evaluator.policy = evaluator.policy.with_(static_checks=True)
        honest = evaluator.verify(task, load_candidate(SOLUTION))
        assert (honest.status, honest.rule, honest.violations) == ("correct", None, []), honest.summary()
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        shutil.rmtree(escape_dir, ignore_errors=True)


def test_a_service_job_cannot_write_outside_and_the_next_job_is_served(caches, tmp_path):
    """The wire route: a job whose source path climbs out of the build directory is refused before
    anything is written, and an honest job through the same service is built as on a clean cache."""
    from cuda_agent.service import RemoteEvaluator, local_service, make_server
    from cuda_agent.service.messages import candidate_to_wire

    attacked, clean = caches
    service = local_service("cpu", cache_dir=attacked, sandbox="bwrap")
    server = make_server(service, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    target = Path.home() / f"iso-escape-{uuid.uuid4().hex[:8]}.py"
    try:
        wire = candidate_to_wire(load_candidate(SOLUTION))
        depth = len(attacked.parts) + 8
        wire["extensions"][0]["sources"]["../" * depth + str(target).lstrip("/")] = "escaped = True\n"
        request = urllib.request.Request(url + "/jobs", data=json.dumps({"op": "build", "candidate": wire}).encode())
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 400
        assert not target.exists()
        built = RemoteEvaluator(url).build(load_candidate(SOLUTION))
        fresh = build(load_candidate(SOLUTION), "cpu", cache_dir=clean, sandbox=SANDBOX)
        assert built.ok and fresh.ok
        assert defined_symbols(built.modules["cuda_extension"]) == defined_symbols(fresh.modules["cuda_extension"])
        # The probe was built before the service took a job.
        assert list((attacked / "probe" / "builds").iterdir())
    finally:
        server.shutdown()
        server.server_close()
        service.close()
        target.unlink(missing_ok=True)


@pytest.mark.parametrize("rounds", [4])
def test_contamination_many_attackers_then_honest_candidates_as_on_a_clean_cache(caches, rounds):
    """Many attacker builds at once (colliding names, a compile that writes where it may not, a probe
    stand-in), repeated; then honest candidates through the same cache: what each links is what it links
    on a clean cache, and no honest unit's object holds an attacker's marker."""
    attacked, clean = caches
    writer = ('#include <cstdint>\n'
              f'extern "C" const char iso_marker2[] = "{MARKER}";\n'
              'extern "C" void scaled_swish_launch(const float* x, float* y, int64_t n, float scale) {}\n')
    for round_ in range(rounds):
        text = kernel_text(100 + round_)
        attackers = [
            workspace({KERNEL: text, "kernels__scaled_swish.cpp": poisoner(100 + round_)}),
            # -MF: the compiler writes a file where it is told; aimed at the objects beside its own.
            Candidate(model_new="", kind="workspace", origin="writer", extensions=(Extension(
                name="cuda_extension", sources={"kernels/w.cpp": writer + f"// {round_}\n"},
                cflags=("-MD", "-MF", "../../obj/cuda_extension/" + "x" * 3)),)),
            workspace({KERNEL: text, "kernels/probe.cpp": poisoner(round_)}),
        ]
        threads = [threading.Thread(target=build, args=(a, "cpu"), kwargs={"cache_dir": attacked, "sandbox": SANDBOX})
                   for a in attackers for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        victim = workspace({KERNEL: text})
        after = build(victim, "cpu", cache_dir=attacked, sandbox=SANDBOX)
        fresh = build(victim, "cpu", cache_dir=clean, sandbox=SANDBOX)
        assert after.ok and fresh.ok
        assert MARKER.encode() not in Path(after.modules["cuda_extension"]).read_bytes()
        assert defined_symbols(after.modules["cuda_extension"]) == defined_symbols(fresh.modules["cuda_extension"])
    honest = {json.loads(r.read_text())["unit"]: r for r in attacked.glob("objects/*/*/record.json")}
    for unit, record in honest.items():
        if unit in (KERNEL, "kernels/scaled_swish_binding.cpp", *FIXED_FILES):
            assert MARKER.encode() not in (record.parent / "object").read_bytes(), unit
    assert fixed_file("binding.cpp")  # the fixed glue is the project's own
