"""Guard: policy checks on what a candidate's code may use.

Static checks (``check_model_new``, ``check_native_source``, ``check_candidate``)
read the sources before anything is built: no torch compute in ``ModelNew.forward``
or in the C++/CUDA, no vendor library beyond the policy, no threads, processes,
side streams, frame walking, monkeypatching or tricks that hide a name from the
check. ``audit_symbols`` reads what the compiler actually emitted: the symbols a
built ``.so``/``.o`` imports, where macros, templates and overloads are resolved.

These are a first line, and knowingly incomplete (tensor operators in Python,
Python objects reached from C++, whatever a clever macro builds). The runtime
guards, which intercept torch dispatch in the worker while forward runs and
watch threads and streams, catch what they miss. Rule names are in ``RULES``.
"""

from cuda_agent.guard.policy import RULES, RUNTIME_RULES, STATIC_RULES, CodePolicy, Violation
from cuda_agent.guard.static import check_candidate, check_model_new, check_native_source
from cuda_agent.guard.symbols import SymbolAuditError, audit_symbols

__all__ = [
    "RULES",
    "RUNTIME_RULES",
    "STATIC_RULES",
    "CodePolicy",
    "SymbolAuditError",
    "Violation",
    "audit_symbols",
    "check_candidate",
    "check_model_new",
    "check_native_source",
]
