"""Single-turn episodes (the paper's stage 1): the model writes the whole solution in one reply, no tools.

The reply holds the files of the agent's workspace as fenced blocks, each after a line naming its path
(``### model_new.py``, then a fenced block). A reply with one unnamed Python block is read as a
KernelBench-style ``ModelNew`` file with ``load_inline`` sources, or as a Triton ``model_new.py`` (its
``@triton.jit`` kernels and ``ModelNew``). ``language`` (``cuda`` or ``triton``) says which the prompt asks
for and which the reply must be. A reply that yields no candidate earns
the failure reward, as an incorrect one does. An evaluation without a verdict (the evaluator could not decide:
a busy host) earns no reward at all: ``None``, with the reason, which every consumer passes on in its own
library's way and never as the failure reward.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from cuda_agent.candidates import Candidate, CandidateError, load_candidate
from cuda_agent.candidates.candidate import SOURCE_SUFFIXES
from cuda_agent.candidates.triton import check_language, triton_kernels
from cuda_agent.evaluate.result import no_reward_reason
from cuda_agent.tasks import Task

FAILURE_REWARD = -1.0
_PATH = r"[\w./-]+"
# A path line (markdown heading, bold, backticks or "File:" in front of it), then a fenced block.
_NAMED_BLOCK = re.compile(
    r"^[ \t]*(?:#{1,6}[ \t]*|\*\*|File:[ \t]*|`)?(?P<path>" + _PATH + r")`?(?:\*\*)?:?[ \t]*\n"
    r"[ \t]*```[\w+-]*[ \t]*\n(?P<body>.*?)\n[ \t]*```", re.MULTILINE | re.DOTALL)
_ANY_BLOCK = re.compile(r"```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)\n[ \t]*```", re.DOTALL)

INSTRUCTIONS = """Write a faster implementation of the PyTorch program below as a CUDA extension.
Reply with the complete files, each as a path line followed by a fenced code block:

### model_new.py
```python
(class ModelNew: same constructor and forward signature as Model; forward calls the extension,
 imported as `import cuda_extension`)
```
### kernels/<name>.cu
```cuda
(your kernels and a host function that launches them)
```
### kernels/<name>_binding.cpp
```cpp
(#include "../binding_registry.h"; a function that registers the host functions with
 REGISTER_BINDING(<name>, register_fn))
```

Torch may only allocate tensors and take views; all computation runs in your kernels.

The program:
```python
{code}
```
"""


TRITON_INSTRUCTIONS = """Write a faster implementation of the PyTorch program below with Triton kernels.
Reply with the complete file, as a path line followed by a fenced code block:

### model_new.py
```python
(import triton and triton.language as tl; your @triton.jit kernels; class ModelNew: same constructor
 and forward signature as Model, forward allocates the outputs and launches the kernels)
```

Torch may only allocate tensors and take views; all computation runs in your Triton kernels. Use
triton.jit, triton.language, triton.autotune/Config/heuristics, triton.cdiv and triton.next_power_of_2;
kernels are compiled and autotuned once, on the program's input shapes.

The program:
```python
{code}
```
"""


def single_turn_messages(task: Task, language: str = "cuda") -> list[dict[str, str]]:
    """The chat messages of a single-turn episode for ``task``, asking for kernels in ``language``."""
    check_language(language)
    template = TRITON_INSTRUCTIONS if language == "triton" else INSTRUCTIONS
    return [{"role": "user", "content": template.format(code=task.code.strip())}]


def reply_files(text: str) -> dict[str, str]:
    """``path -> source`` of every named block in a reply; refuses paths outside the workspace."""
    files: dict[str, str] = {}
    for match in _NAMED_BLOCK.finditer(text):
        path = PurePosixPath(match["path"])
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise CandidateError(f"the reply names a file outside the workspace: {match['path']}")
        if path.as_posix() != "model_new.py" and (path.suffix not in SOURCE_SUFFIXES or path.parts[0] != "kernels"):
            continue  # prose that looks like a path line, or a file the build would not read
        files[path.as_posix()] = match["body"] + "\n"
    return files


def candidate_from_reply(text: str, where: Path | None = None, language: str | None = None) -> Candidate:
    """The candidate a single-turn reply writes, or ``CandidateError`` saying why there is none. The
    files are written under ``where`` (a temporary directory without one) and read back as a workspace.
    ``language``: the one the reply must be in (None: read from it)."""
    check_language(language)
    files = reply_files(text)
    if "model_new.py" not in files:
        python = [m["body"] for m in _ANY_BLOCK.finditer(text) if m["lang"] in ("python", "py", "")]
        if len(python) == 1 and ("load_inline" in python[0] or triton_kernels(python[0])):
            files = {"model_new.py": python[0] + "\n"}
        else:
            raise CandidateError("the reply holds no model_new.py: write each file as a path line "
                                 "(### model_new.py) followed by a fenced code block")
    if where is None:
        where = Path(tempfile.mkdtemp(prefix="cuda-agent-reply-"))
    for name, source in files.items():
        target = where / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    # model_new.py alone is a KernelBench-style file (its sources inline) or a Triton one; with kernels/, a workspace.
    if language == "triton" and list(files) != ["model_new.py"]:
        raise CandidateError("a Triton reply is model_new.py alone (its @triton.jit kernels in it); it also wrote "
                             + ", ".join(sorted(set(files) - {"model_new.py"})))
    candidate = load_candidate(where / "model_new.py" if list(files) == ["model_new.py"] else where, language=language)
    return candidate


@dataclass(frozen=True)
class SingleTurnOutcome:
    reward: float | None  # None: no verdict (no reward; ``reason`` says why), never the failure reward
    reason: str  # why the reply earned what it did
    evaluation: dict[str, Any] | None = None  # the evaluator's result, when there was a candidate

    @property
    def no_verdict(self) -> bool:
        """The evaluator could not decide: the sample has no reward (masked or dropped by a trainer)."""
        return self.reward is None

    @property
    def status(self) -> str:
        """The evaluation's status, or "no candidate" when the reply wrote nothing usable."""
        return (self.evaluation or {}).get("status") or "no candidate"


def score_reply(task: Task, text: str, evaluator: Any, where: Path, language: str | None = None) -> SingleTurnOutcome:
    """Parse a reply and evaluate what it writes; the failure reward when it writes nothing usable (or not in
    ``language``, when given), no reward (``None``) when the evaluation has no verdict."""
    try:
        candidate = candidate_from_reply(text, where, language)
    except CandidateError as exc:
        return SingleTurnOutcome(FAILURE_REWARD, f"no candidate: {exc}")
    result = evaluator.evaluate(task, candidate)
    if result.no_verdict:
        return SingleTurnOutcome(None, no_reward_reason(result.to_dict()), result.to_dict())
    reward = FAILURE_REWARD if result.reward is None else float(result.reward)
    return SingleTurnOutcome(reward, result.status if result.rule is None else f"{result.status} ({result.rule})",
                             result.to_dict())


def completion_text(completion: Any) -> str:
    """A trainer's completion as text: a string (standard format) or chat messages (conversational format: the
    assistant's contents joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content") or "")
    return "\n".join(str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant")


def score_completion(task: Task, completion: Any, options: Any, language: str | None = None) -> SingleTurnOutcome:
    """One single-turn reply (text or chat messages) scored for ``task``: parsed into a candidate and evaluated
    (``score_reply``) by an evaluator ``options`` (``train.evaluators.EvaluatorOptions``) lends for the call, in a
    scratch folder removed afterwards. Every stack's single-turn reward is this (TRL, verl, verifiers, OpenEnv).
    ``language``: the kernel language the prompt asked for (None: whichever the reply is)."""
    with options.lend() as evaluator, tempfile.TemporaryDirectory(prefix="cuda-agent-reply-") as where:
        return score_reply(task, completion_text(completion), evaluator, Path(where), language)
