"""The C++/CUDA source scan: a small tokenizer and rules over its tokens.

Line splices are undone first (as the compiler's phase 2 does), so a name split
by backslash-newline is still seen whole; comments and string/char literals
(raw strings included) never produce findings. Names are checked after namespace
aliases and single-name macros are expanded. What the token scan cannot see
(macro expansion in general, overload resolution, templates) the symbol audit
of the built objects sees, because it reads what the compiler actually emitted.
"""

from __future__ import annotations

import array
from bisect import bisect_right
from dataclasses import dataclass

from cuda_agent.guard import names as N
from cuda_agent.guard.policy import CodePolicy, Violation

_RAW_PREFIXES = frozenset({"R", "u8R", "uR", "UR", "LR"})
_STRING_PREFIXES = frozenset({"u8", "u", "U", "L"})
_PUNCTUATORS = sorted(
    ["%:%:", "->*", "<<=", ">>=", "...", "::", "->", "##", "%:", "<:", ":>", "<%", "%>", "<<", ">>", "<=", ">=",
     "==", "!=", "&&", "||", "++", "--", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", ".*"],
    key=len,
    reverse=True,
)
_DIGRAPHS = {"%:%:": "##", "%:": "#", "<:": "[", ":>": "]", "<%": "{", "%>": "}"}
_HOST_SUFFIXES = (".cpp", ".cc", ".cxx")
_ATEN_ROOTS = frozenset({"at", "torch", "aten"})
# Directives whose text is not code.
_OPAQUE_DIRECTIVES = frozenset({"include", "include_next", "import", "error", "warning", "line", "pragma", "ident"})
# C/C++ and CUDA math and std algorithms that share a name with an ATen op: an
# unqualified call of these is the C function, not ATen.
_C_NAMES = frozenset(
    {"abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "cbrt", "pow", "sin", "cos",
     "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc",
     "erfinv", "erfcinv", "lgamma", "tgamma", "floor", "ceil", "round", "trunc", "fmod", "remainder", "copysign",
     "hypot", "fma", "fmax", "fmin", "max", "min", "isnan", "isinf", "isfinite", "signbit", "nextafter", "frexp",
     "ldexp", "rint", "nearbyint", "sinc", "clamp", "lerp", "gcd", "lcm", "sort", "unique", "fill", "copy", "swap",
     "reverse", "real", "imag", "conj", "arg", "norm", "polar", "exp10", "i0", "any", "all", "count",
     "mean", "sum", "prod", "rand", "randn", "sign", "square", "floor_divide", "minimum", "maximum", "where",
     "div", "mul", "add", "sub", "neg", "size", "numel", "to", "select", "flip", "dot", "cross", "outer",
     "kron", "frac", "digamma", "polygamma", "absolute", "negative", "positive", "bitwise_not", "logical_not"}
)
_KEYWORDS = frozenset(
    {"if", "for", "while", "switch", "return", "sizeof", "decltype", "alignof", "static_cast", "dynamic_cast",
     "reinterpret_cast", "const_cast", "typeid", "noexcept", "static_assert", "catch", "new", "delete", "throw",
     "defined", "__launch_bounds__", "__attribute__", "__declspec", "alignas"}
)
# Keywords that may stand before `::name` or before a call without declaring it.
_LEADING_KEYWORDS = frozenset(
    {"return", "else", "case", "do", "throw", "co_return", "co_yield", "co_await", "new", "delete", "goto",
     "typename", "using", "template", "const", "constexpr", "static", "inline", "extern", "volatile", "friend",
     "virtual", "operator", "and", "or", "not"}
)
_SYSCALL_ASM = ("syscall", "sysenter", "int $0x80", "int 0x80", "svc ")


@dataclass(frozen=True)
class Token:
    kind: str  # ident | number | string | char | punct
    text: str
    line: int  # source line, for reports
    logical: int  # line after splicing: a directive ends with its logical line
    start: int  # offsets in the spliced text: adjacency tells `f(` from `f (`
    end: int


@dataclass
class _Define:
    name: str
    params: tuple[str, ...] | None  # None: object-like
    body: tuple[int, int]  # token index range [start, end)
    hash_index: int


# -- tokenizer ---------------------------------------------------------------------------


def _splice(text: str) -> tuple[str, array.array]:
    """Undo backslash-newline (GCC also accepts spaces between them); returns the
    spliced text and, for each of its line starts, the source line it came from."""
    out: list[str] = []
    starts = array.array("l", [0])  # spliced offset where each source line's text resumes
    lines = array.array("l", [1])
    line, i, n, size = 1, 0, len(text), 0
    while i < n:
        c = text[i]
        if c == "\\":
            k = i + 1
            while k < n and text[k] in " \t":
                k += 1
            nl = 2 if text.startswith("\r\n", k) else 1 if k < n and text[k] == "\n" else 0
            if nl:
                line += 1
                i = k + nl
                starts.append(size)
                lines.append(line)
                continue
        out.append(c)
        size += 1
        i += 1
        if c == "\n":
            line += 1
            starts.append(size)
            lines.append(line)
    return "".join(out), (starts, lines)  # type: ignore[return-value]


def tokenize(source: str) -> list[Token]:
    text, (starts, lines) = _splice(source)

    def line_at(offset: int) -> int:
        return lines[bisect_right(starts, offset) - 1]

    tokens: list[Token] = []
    i, n, logical = 0, len(text), 1

    def add(kind: str, start: int, end: int, value: str | None = None) -> None:
        tokens.append(Token(kind, value if value is not None else text[start:end], line_at(start), logical, start, end))

    while i < n:
        c = text[i]
        if c == "\n":
            logical += 1
            i += 1
        elif c in " \t\r\f\v":
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            logical += text.count("\n", i, end)
            i = end
        elif c.isalpha() or c in "_$" or ord(c) > 127:
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] in "_$" or ord(text[j]) > 127):
                j += 1
            word = text[i:j]
            if j < n and text[j] == '"' and word in _RAW_PREFIXES:
                end = _raw_string_end(text, j)
            elif j < n and text[j] in "\"'" and word in _STRING_PREFIXES:
                end = _quoted_end(text, j)
            else:
                add("ident", i, j)
                i = j
                continue
            logical_before = logical
            logical += text.count("\n", i, end)
            tokens.append(Token("string", text[i:end], line_at(i), logical_before, i, end))
            i = end
        elif c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            j = i + 1
            while j < n:
                ch = text[j]
                if ch in "eEpP" and j + 1 < n and text[j + 1] in "+-":
                    j += 2
                elif ch.isalnum() or ch in "._":
                    j += 1
                elif ch == "'" and j + 1 < n and text[j + 1].isalnum():
                    j += 2  # digit separator: 1'000'000
                else:
                    break
            add("number", i, j)
            i = j
        elif c in "\"'":
            end = _quoted_end(text, i)
            add("string" if c == '"' else "char", i, end)
            i = end
        else:
            punct = next((p for p in _PUNCTUATORS if text.startswith(p, i)), c)
            if punct == "<:" and text.startswith("<::", i) and not text.startswith(("<:::", "<::>"), i):
                punct = "<"  # C++11: `<::` is `<` followed by `::`
            add("punct", i, i + len(punct), _DIGRAPHS.get(punct, punct))
            i += len(punct)
    return tokens


def _quoted_end(text: str, start: int) -> int:
    quote, j, n = text[start], start + 1, len(text)
    while j < n:
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        elif text[j] == "\n":
            return j  # unterminated: the compiler rejects it; stop at the line end
        else:
            j += 1
    return n


def _raw_string_end(text: str, quote: int) -> int:
    open_paren = text.find("(", quote + 1, quote + 18)
    delimiter = text[quote + 1 : open_paren] if open_paren >= 0 else None
    if delimiter is None or any(ch in delimiter for ch in ' ()\\\t\n"'):
        return _quoted_end(text, quote)
    close = text.find(")" + delimiter + '"', open_paren + 1)
    return len(text) if close < 0 else close + len(delimiter) + 2


# -- scan ------------------------------------------------------------------------------------


def check_cxx(source: str, filename: str, policy: CodePolicy, declared: frozenset[str] = frozenset()) -> list[Violation]:
    return _Scanner(tokenize(source), filename, policy, declared).run()


def declared_functions(source: str) -> set[str]:
    """Functions, variables and macros a source defines or declares (for calls from other files)."""
    scanner = _Scanner(tokenize(source), "", CodePolicy(), frozenset())
    return scanner.declared_here()


class _Scanner:
    def __init__(self, tokens: list[Token], filename: str, policy: CodePolicy, declared: frozenset[str]):
        self.tokens = tokens
        self.filename = filename
        self.policy = policy
        # Inline PTX is legitimate device code; a .cpp file is host code only.
        self.host_only = filename.endswith(_HOST_SUFFIXES)
        self.found: list[tuple[int, Violation]] = []
        self.defines: list[_Define] = []
        self.opaque: set[int] = set()  # token indices inside #include/#pragma/#error lines
        self.namespace_aliases: dict[str, list[str]] = {}
        self.macro_aliases: dict[str, list[str]] = {}
        self._read_directives()
        self.declared = declared | self.declared_here()

    def run(self) -> list[Violation]:
        tokens = self.tokens
        for i, tok in enumerate(tokens):
            if i in self.opaque:
                continue
            if tok.kind == "ident":
                self._check_ident(i)
            elif tok.kind == "punct" and tok.text == "##":
                self.report("token-paste", i, "`##` builds identifiers the scan cannot see")
        self._check_defines()
        return [v for _, v in self.found]

    def report(self, rule: str, index: int, message: str) -> None:
        if rule == "stream" and self.policy.allow_streams:
            return
        self.found.append((index, Violation(rule, self.filename, self.tokens[index].line, message)))

    # helpers over the token list
    def text(self, i: int) -> str:
        return self.tokens[i].text if 0 <= i < len(self.tokens) else ""

    def _next_is_call(self, i: int) -> bool:
        return self.text(i + 1) == "("

    # directives
    def _read_directives(self) -> None:
        tokens = self.tokens
        for i, tok in enumerate(tokens):
            at_line_start = i == 0 or tokens[i - 1].logical != tok.logical
            if not (tok.text == "#" and tok.kind == "punct" and at_line_start):
                continue
            end = i + 1
            while end < len(tokens) and tokens[end].logical == tok.logical:
                end += 1
            keyword = self.text(i + 1)
            if keyword in _OPAQUE_DIRECTIVES:
                if keyword == "pragma" and any(t.text == "omp" for t in tokens[i + 2 : end]):
                    self.report("thread", i, "`#pragma omp` starts OpenMP threads")
                self.opaque.update(range(i, end))
            elif keyword == "define" and i + 2 < end and tokens[i + 2].kind == "ident":
                self._read_define(i, end)

    def _read_define(self, hash_index: int, end: int) -> None:
        tokens = self.tokens
        name_tok = tokens[hash_index + 2]
        j = hash_index + 3
        params: tuple[str, ...] | None = None
        if j < end and tokens[j].text == "(" and tokens[j].start == name_tok.end:
            k = j + 1
            found = []
            while k < end and tokens[k].text != ")":
                if tokens[k].kind == "ident" or tokens[k].text == "...":
                    found.append("__VA_ARGS__" if tokens[k].text == "..." else tokens[k].text)
                k += 1
            params = tuple(found)
            j = k + 1
        define = _Define(name_tok.text, params, (j, end), hash_index)
        self.defines.append(define)
        self.opaque.update((hash_index, hash_index + 1, hash_index + 2))
        body = [t.text for t in tokens[j:end]]
        if params is None and body and _is_qualified_name(body):
            self.macro_aliases[name_tok.text] = [b for b in body if b != "::"]

    def _check_defines(self) -> None:
        """Macros that hide names: built from their arguments, or aliasing a forbidden one."""
        for define in self.defines:
            start, end = define.body
            body = self.tokens[start:end]
            if define.params:
                for k, tok in enumerate(body):
                    if tok.text not in define.params:
                        continue
                    before = body[k - 1].text if k > 0 else ""
                    after = body[k + 1].text if k + 1 < len(body) else ""
                    if before in ("::", ".", "->") or after == "::":
                        self.report("token-paste", define.hash_index,
                                    f"macro {define.name} builds a qualified or member name from its argument {tok.text}")
                        break
            if body and (body[0].text in ("::", ".", "->") or body[-1].text in ("::", ".", "->")):
                self.report("token-paste", define.hash_index, f"macro {define.name} hides a member access or qualifier")
            inside = [v for i, v in self.found if start <= i < end and v.rule != "token-paste"]
            if inside:
                self.report("token-paste", define.hash_index,
                            f"macro {define.name} expands to forbidden code ({inside[0].message})")

    def declared_here(self) -> set[str]:
        """Names this file defines or declares as functions, variables or macros."""
        tokens, names = self.tokens, {d.name for d in self.defines}
        for i, tok in enumerate(tokens):
            if tok.kind != "ident" or i in self.opaque:
                continue
            nxt = self.text(i + 1)
            before = tokens[i - 1] if i > 0 else None
            if nxt == "=" and self.text(i - 1) not in (".", "->", "::"):
                names.add(tok.text)  # auto relu = [](float v) { ... };
            elif nxt != "(" or before is None:
                continue
            elif before.kind == "ident" and before.text not in _KEYWORDS | _LEADING_KEYWORDS:
                names.add(tok.text)  # `float gelu(` / `torch::Tensor relu(`: a type, then the name
            elif before.text in ("*", "&", ">") and self._is_declaration(i):
                names.add(tok.text)  # `float* f(` / `std::vector<int> f(`
        return names

    def _is_declaration(self, i: int) -> bool:
        """After the parameter list of `name(` comes a body or `;` of a declaration."""
        depth, k = 0, i + 1
        while k < len(self.tokens):
            t = self.text(k)
            depth += t == "("
            depth -= t == ")"
            k += 1
            if depth == 0:
                break
        return self.text(k) in ("{", ";", "const", "noexcept", "->", "override")

    # identifiers
    def _check_ident(self, i: int) -> None:
        tokens, tok = self.tokens, self.tokens[i]
        prev = self.text(i - 1)
        word = tok.text
        if prev in (".", "->"):
            self._check_member(i)
            return
        global_scope = False
        if prev == "::":
            before = tokens[i - 2] if i >= 2 else None
            if before is not None and before.kind == "ident" and before.text not in _LEADING_KEYWORDS:
                return  # inside a qualified name: checked from its first segment
            if before is not None and before.text == ">":
                return  # a member of a template's specialisation (numeric_limits<T>::max)
            global_scope = True
        segments, last = self._qualified(i)
        self._check_qualified(segments, i, last, global_scope)
        for seg in segments:
            self._check_word(seg, i)
        if word in ("asm", "__asm__", "__asm"):
            self._check_asm(i)
        elif word == "using" and self.text(i + 1) == "namespace":
            target, _ = self._qualified(i + 2)
            if target and target[0] in _ATEN_ROOTS:
                self.report("token-paste", i, f"`using namespace {'::'.join(target)}` hides which ATen names are called")
        elif word == "namespace" and self.text(i + 2) == "=":
            target, _ = self._qualified(i + 3)
            if target:
                self.namespace_aliases[self.text(i + 1)] = target
        elif word == "namespace" and prev != "using" and self.text(i + 1) in _ATEN_ROOTS | {"c10"}:
            self.report("token-paste", i, f"code inside namespace {self.text(i + 1)} calls its ops unqualified")
        elif word == "_Pragma" and "omp" in self.text(i + 2):
            self.report("thread", i, "`_Pragma(\"omp ...\")` starts OpenMP threads")

    def _qualified(self, i: int) -> tuple[list[str], int]:
        """Segments of the qualified name starting at token i (aliases expanded), and its last index."""
        tokens = self.tokens
        segments: list[str] = []
        k = i
        if self.text(k) == "::":
            k += 1
        while k < len(tokens) and tokens[k].kind == "ident":
            segments.append(tokens[k].text)
            if self.text(k + 1) == "::" and k + 2 < len(tokens) and tokens[k + 2].kind == "ident":
                k += 2
                if tokens[k].text == "template" and k + 1 < len(tokens):
                    k += 1
            else:
                break
        return self._expand(segments), k

    def _expand(self, segments: list[str]) -> list[str]:
        for _ in range(8):  # bounded: aliases may refer to each other
            expanded: list[str] = []
            for n, seg in enumerate(segments):
                if n == 0 and seg in self.namespace_aliases:
                    expanded += self.namespace_aliases[seg]
                elif seg in self.macro_aliases:
                    expanded += self.macro_aliases[seg]
                else:
                    expanded.append(seg)
            if expanded == segments:
                break
            segments = expanded
        return segments

    def _check_qualified(self, segments: list[str], i: int, last: int, global_scope: bool) -> None:
        if not segments:
            return
        root = segments[0]
        shown = "::".join(segments)
        if root in _ATEN_ROOTS and len(segments) > 1:
            self._check_aten(segments, i, shown)
        elif root == "std" and len(segments) > 1 and segments[1] in ("thread", "jthread", "async"):
            self.report("thread", i, f"{shown} starts a thread")
        elif root in ("py", "pybind11") and segments[-1] in ("import", "eval", "exec", "eval_file", "module_"):
            if segments[-1] != "module_" or self.text(last + 2) == "import":
                self.report("dynamic-access", i, f"{shown}: Python code run from C++")
        free_call = len(segments) == 1 or (len(segments) == 2 and root == "std")
        if free_call and self._next_is_call(last):
            name = segments[-1]
            if name in N.NATIVE_CALL_RULES:
                self.report(N.NATIVE_CALL_RULES[name], i, f"`{name}()` {_NATIVE_REASONS[N.NATIVE_CALL_RULES[name]]}")
            elif len(segments) == 1 and not global_scope and self._adl_op(name):
                self.report("aten-compute", i,
                            f"unqualified `{name}(...)`: on a tensor, argument-dependent lookup calls at::{name}")

    def _adl_op(self, name: str) -> bool:
        base = N.op_base(name)
        return (
            base in N.aten_op_names() and not N.op_allowed(base, self.policy.allowed_aten)
            and name not in _C_NAMES and name not in _KEYWORDS and name not in self.declared
            and not name.startswith("_")
        )

    def _check_aten(self, segments: list[str], i: int, shown: str) -> None:
        rest = segments[1:]
        head, name = rest[0], rest[-1]
        allowed = self.policy.allowed_aten
        if head == "native":
            self.report("aten-compute", i, f"{shown}: ATen's own kernels")
        elif head == "_ops" and len(rest) > 1:
            op = N.aten_op_structs().get(rest[1], rest[1])
            if not N.op_allowed(op, allowed):
                self.report("aten-compute", i, f"{shown}: the ATen op {op}")
        elif head in ("nn", "jit"):
            self.report("aten-compute", i, f"{shown}: torch::{head} runs torch code")
        elif head == "cuda" and len(rest) > 1 and rest[1] == "blas":
            self.report("aten-compute", i, f"{shown}: ATen's BLAS wrappers")
        elif name in N.ATEN_LIBRARY_HANDLES:
            self._check_library(N.ATEN_LIBRARY_HANDLES[name], i, shown)
        elif name in N.ATEN_THREAD_NAMES:
            self.report("thread", i, f"{shown} runs work on ATen's thread pool")
        elif head in ("TensorIterator", "TensorIteratorBase", "TensorIteratorConfig"):
            self.report("aten-compute", i, f"{shown}: ATen's elementwise machinery")
        elif head in ("Tensor", "TensorBase") and len(rest) > 1:
            if rest[1] in N.cpp_compute_methods() and rest[1] not in allowed:
                self.report("aten-compute", i, f"{shown}: the ATen op {rest[1]}")
        elif len(rest) == 1 or head in N.ATEN_BACKEND_NAMESPACES or head == "functional":
            base = N.op_base(name)
            if base in N.aten_op_names() and not N.op_allowed(base, allowed):
                self.report("aten-compute", i, f"{shown}: the ATen op {base}")

    def _check_member(self, i: int) -> None:
        name = self._expand([self.tokens[i].text])[-1]
        nxt = self.text(i + 1)
        if nxt not in ("(", "<"):
            return
        if name in N.cpp_compute_methods() and name not in self.policy.allowed_aten:
            self.report("aten-compute", i, f"`.{name}()`: the ATen op {name} on a tensor")
        elif name == "attr" and nxt == "(":
            self.report("dynamic-access", i, "`.attr(...)` reaches Python objects from C++")

    def _check_word(self, word: str, i: int) -> None:
        family = N.library_family(word)
        if family and family not in self.policy.libraries:
            self._check_library(family, i, word)
        rule = N.NATIVE_IDENTIFIER_RULES.get(word)
        if rule:
            self.report(rule, i, f"`{word}` {_NATIVE_REASONS[rule]}")
        elif word.endswith(("_ptsz", "_ptds")):
            self.report("stream", i, f"`{word}` uses the per-thread default stream")

    def _check_library(self, family: str, i: int, shown: str) -> None:
        if family not in self.policy.libraries:
            allowed = ", ".join(self.policy.libraries) or "none"
            self.report("library", i, f"{shown}: {family} is not an allowed library (allowed: {allowed})")

    def _check_asm(self, i: int) -> None:
        if self.host_only:
            self.report("syscall", i, "inline assembly in host code")
            return
        k, text = i + 1, []
        while k < len(self.tokens) and self.text(k) != ";":
            if self.tokens[k].kind == "string":
                text.append(self.tokens[k].text)
            k += 1
        joined = " ".join(text)
        if any(marker in joined for marker in _SYSCALL_ASM):
            self.report("syscall", i, "inline assembly makes a system call")


def _is_qualified_name(body: list[str]) -> bool:
    """`at::matmul`, `::at`, `matmul`: a body that is just a (qualified) name."""
    if not body or body[-1] == "::":
        return False
    expect_ident = body[0] != "::"
    for piece in body[1:] if body[0] == "::" else body:
        if expect_ident != (piece != "::" and (piece[0].isalpha() or piece[0] == "_")):
            return False
        expect_ident = not expect_ident
    return True


_NATIVE_REASONS = {
    "cache-control": "controls L2 persistence, which keeps data cached across the flush before timed calls",
    "thread": "starts threads",
    "subprocess": "runs other programs",
    "native-load": "loads native code outside the build",
    "syscall": "is raw system access",
    "stream": "puts work on a stream other than the current one",
    "dynamic-access": "runs Python code from C++",
    "monkeypatch": "registers kernels over torch's own",
    "aten-compute": "calls ATen ops by name through the dispatcher",
}
