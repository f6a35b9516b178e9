"""Issue 44's shape rules on the package's sources (src/): no .py or .c (.h) file over 800
lines, no Python function over 80 lines (its `def` line to its last, decorators not counted) and
no C function over 80 lines (its signature's first line to its closing brace). The checker is
tested on generated files first: one line over each limit fails, the limit itself passes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80

# Comments, string and character literals: the first that starts at a position wins, so a
# quote inside a comment or a comment marker inside a string is not one.
_C_SKIPPED = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
_C_NAME = re.compile(r"([A-Za-z_]\w*)\s*$")


def python_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, line, lines) of every function and method, nested ones too."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def c_code(text: str) -> str:
    """`text` with its comments, literals and preprocessor lines (a directive and its
    continuation lines: macro bodies) blanked, its lines where they were. Every branch of an
    #if stays: each must keep the braces balanced (as ours do), which `c_functions` checks."""
    code = _C_SKIPPED.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    lines, directive = code.split("\n"), False
    for i, line in enumerate(lines):
        if directive or line.lstrip().startswith("#"):
            directive = line.rstrip().endswith("\\")
            lines[i] = ""
    return "\n".join(lines)


def c_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, line, lines) of every function defined at the top level: a brace block there whose
    text since the last top-level `;` or `}` ends with `)` and assigns nothing (not a struct,
    an initializer)."""
    code = c_code(text)
    found, depth, start, head = [], 0, 0, 0
    for i, ch in enumerate(code):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            assert depth >= 0, f"an unmatched '}}' on line {code.count(chr(10), 0, i) + 1}"
            if depth == 0:
                header = code[head:start].strip()
                if header.endswith(")") and "=" not in header:
                    name = _function_name(header)
                    first = code.count("\n", 0, head + code[head:start].index(header[0])) + 1
                    last = code.count("\n", 0, i) + 1
                    found.append((name, first, last - first + 1))
                head = i + 1
        elif ch == ";" and depth == 0:
            head = i + 1
    assert depth == 0, "unbalanced braces"
    return found


def _function_name(header: str) -> str:
    """The name before the parameter list that closes a function's header."""
    depth = 0
    for i in range(len(header) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(header[i], 0)
        if depth == 0:
            match = _C_NAME.search(header[:i])
            return match.group(1) if match else "?"
    return "?"


def shape_problems(root: Path) -> list[str]:
    """Each file and function under `root` over its limit, as `path: what`."""
    problems = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".c", ".h"):
            continue
        text = path.read_text()
        where = path.relative_to(root)
        if len(text.splitlines()) > MAX_FILE_LINES:
            problems.append(f"{where}: {len(text.splitlines())} lines")
        functions = python_functions(text) if path.suffix == ".py" else c_functions(text)
        for name, line, lines in functions:
            if lines > MAX_FUNCTION_LINES:
                problems.append(f"{where}:{line}: {name} is {lines} lines")
    return problems


def _python_function(name: str, lines: int, decorators: int = 0) -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return "@staticmethod\n" * decorators + f"def {name}():\n{body}    return 0\n"


# Lines of a C function's body that a naive count of braces, quotes or comments gets wrong.
_TRICKY_C = [
    '    const char *s = "} {{ \\" }";  /* a brace } in a comment { */',
    "    char c = '{', d = '\\'', e = '}';  // and { here",
    "#define BLOCK(x) \\",
    "    do { (x)++; \\",
    "    } while (0)",
    "#if defined(WIDE)",
    "    if (c) { d++; }",
    "#else",
    "    if (d) { c++; }",
    "#endif",
    "    /* a comment over",
    "       two lines } */",
]


def _c_function(name: str, lines: int) -> str:
    """A function of `lines` lines: its signature on two lines, its closing brace on one."""
    body = _TRICKY_C + [f"    n += {i};" for i in range(lines - 3 - len(_TRICKY_C))]
    return "\n".join([f"static int {name}(int n,", "                int m) {", *body, "}"]) + "\n"


def test_the_checker_finds_what_is_over_the_limits(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "shapes.py").write_text(
        _python_function("at_the_limit", 80)
        + _python_function("decorated_at_the_limit", 80, decorators=3)
        + _python_function("one_over", 81)
        + "class Holder:\n"
        + "".join("    " + line + "\n" for line in _python_function("method", 81).splitlines())
    )
    (tmp_path / "pkg" / "shapes.c").write_text(
        "typedef struct {\n    int a;\n} pair_t;\n"
        'static const char *NAMES[2] = {"{", "}"};\n'
        "static int prototype(int n);\n"
        + _c_function("c_at_the_limit", 80)
        + _c_function("c_one_over", 81)
    )
    (tmp_path / "long.py").write_text("x = 1\n" * 801)
    (tmp_path / "long_enough.c").write_text("int x;\n" * 800)
    assert c_functions((tmp_path / "pkg" / "shapes.c").read_text()) == [
        ("c_at_the_limit", 6, 80),
        ("c_one_over", 86, 81),
    ]
    assert shape_problems(tmp_path) == [
        "long.py: 801 lines",
        "pkg/shapes.c:86: c_one_over is 81 lines",
        "pkg/shapes.py:164: one_over is 81 lines",
        "pkg/shapes.py:246: method is 81 lines",
    ]


def test_the_package_keeps_the_shape_rules():
    problems = shape_problems(SRC)
    assert not problems, "\n".join(problems)


def test_the_c_scan_finds_the_librarys_functions():
    """The scan sees every function the library defines (its exported ones among them), so a
    long one cannot hide from it."""
    kernels = SRC / "freetoken" / "kernels"
    names = {name for path in kernels.glob("*.c") for name, _, _ in c_functions(path.read_text())}
    header = (kernels / "cpu_native.h").read_text()
    exported = set(re.findall(r"^\w[\w \*]*?\b(ft_\w+)\(", header, re.MULTILINE))
    assert exported and exported <= names
    assert {"qdot_bf16", "qdot_f32", "dot_bf16_bf16", "run_items"} <= names
