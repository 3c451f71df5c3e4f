"""Procedural bug mutations: exact edits per kind on crafted snippets, invariants on real stdlib modules,
and a behavioural check that most mutations change what the code computes."""

from __future__ import annotations

import ast
import bisect
import difflib
import functools
import heapq
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from aitlrt.tasks.mutations import KINDS, Mutation, mutations

STDLIB = {m.__name__: Path(m.__file__).read_text() for m in (textwrap, heapq, bisect, functools)}
# Kinds whose diff is bounded by the changed statement's span rather than by a few lines.
SPAN_KINDS = {
    "invert_if": (ast.If,),
    "remove_condition": (ast.If,),
    "remove_loop": (ast.For, ast.AsyncFor, ast.While),
    "remove_with_try": (ast.With, ast.AsyncWith, ast.Try),
    "remove_method": (ast.FunctionDef, ast.AsyncFunctionDef),
}


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def sources(src: str, kind: str, seeds: range = range(1)) -> set[str]:
    """Every mutated source of one kind, over ``seeds``."""
    return {m.source for seed in seeds for m in mutations(src, seed=seed, per_function=100, kinds=[kind])}


def diff_ops(a: str, b: str) -> list[tuple[str, int, int, int, int]]:
    """difflib's line opcodes (``a`` lines 1-based, half-open), on the region between the common prefix and suffix."""
    x, y = a.splitlines(), b.splitlines()
    common = min(len(x), len(y))
    head = next((i for i in range(common) if x[i] != y[i]), common)
    tail = next((i for i in range(common - head) if x[-1 - i] != y[-1 - i]), common - head)
    ops = difflib.SequenceMatcher(None, x[head : len(x) - tail], y[head : len(y) - tail], autojunk=False).get_opcodes()
    return [(tag, i1 + head + 1, i2 + head + 1, j1 + head + 1, j2 + head + 1) for tag, i1, i2, j1, j2 in ops]


def changed_lines(a: str, b: str) -> int:
    """Lines a unified diff shows as removed or added."""
    return sum(i2 - i1 + j2 - j1 for tag, i1, i2, j1, j2 in diff_ops(a, b) if tag != "equal")


# -- every kind, exact output ---------------------------------------------------------------------------------


def test_swap_operator():
    src = dedent("""
        def f(a, b):
            \"\"\"Add a + b.\"\"\"
            total = 0
            total += a + b  # sum
            return total
    """)
    assert sources(src, "swap_operator") == {
        src.replace("total += a + b", "total -= a + b"),
        src.replace("total += a + b", "total += a - b"),
    }
    src = "def g(x, y):\n    return x * y\n"
    assert sources(src, "swap_operator", range(20)) == {"def g(x, y):\n    return x // y\n", src.replace("*", "/")}


def test_flip_comparison():
    src = dedent("""
        def g(x, items):
            if x < 0 or x not in items:
                return None
            return x is not None
    """)
    assert sources(src, "flip_comparison") == {
        src.replace("x < 0", "x > 0"),
        src.replace("x not in items", "x in items"),
        src.replace("x is not None", "x is None"),
    }


def test_flip_bool_op():
    src = dedent("""
        def h(a, b, c):
            x = a and b and c
            return (a or
                    b)
    """)
    assert sources(src, "flip_bool_op") == {
        src.replace("a and b and c", "a or b or c"),
        src.replace("(a or\n", "(a and\n"),
    }


def test_swap_operands():
    src = dedent("""
        def d(a, b, c, lo):
            if lo <= a:
                return (a + b) - c * 2
            x = a - b - c
            return "x" + b
    """)
    assert sources(src, "swap_operands") == {
        src.replace("lo <= a", "a <= lo"),
        src.replace("(a + b) - c * 2", "c * 2 - (a + b)"),
        src.replace("a - b - c", "c - (a - b)"),
        src.replace("a - b - c", "b - a - c"),
        src.replace('"x" + b', 'b + "x"'),
    }
    src = "def p(a, b):\n    return a ** b ** 2\n"  # ** groups to the right
    pow_swaps = {src.replace("a ** b ** 2", "(b ** 2) ** a"), src.replace("b ** 2", "2 ** b")}
    assert sources(src, "swap_operands") == pow_swaps


def test_break_chain():
    src = dedent("""
        def e(a, b, c, i, n):
            x = a - b - c
            y = a * (b + c)
            return 0 <= i < n or a or c
    """)
    assert sources(src, "break_chain") == {
        src.replace("a - b - c", "a - c"),
        src.replace("a * (b + c)", "a * c"),
        src.replace("0 <= i < n", "0 <= n"),
        src.replace("0 <= i < n or a or c", "0 <= i < n or c"),
    }


def test_constant_shift():
    src = dedent("""
        def first(items, flag=True):
            \"\"\"Item 1.\"\"\"
            return items[1] if flag else None
    """)
    assert sources(src, "constant_shift", range(20)) == {
        src.replace("items[1]", "items[2]"),
        src.replace("items[1]", "items[0]"),
    }


def test_invert_if():
    src = dedent("""
        def sign(x):
            if x >= 0:
                # non-negative
                return 1
            else:
                return -1


        def grade(x):
            if x > 90:
                return "A"
            elif x > 80:
                return "B"
            else:
                return "C"
    """)
    assert sources(src, "invert_if") == {
        src.replace("return 1\n    else:\n        return -1", "return -1\n    else:\n        return 1"),
        src.replace('return "B"\n    else:\n        return "C"', 'return "C"\n    else:\n        return "B"'),
    }


def test_remove_condition():
    src = dedent("""
        def clamp(x, hi):
            if x > hi:  # too big
                x = hi
            return x


        def ping(x):
            if x:
                print(x)


        def grade(x):
            if x > 90:
                return "A"
            elif x > 80:
                return "B"
            return "C"
    """)
    assert sources(src, "remove_condition") == {
        src.replace("    if x > hi:  # too big\n        x = hi\n", ""),
        src.replace("    if x:\n        print(x)\n", "    pass\n"),
        src.replace('    elif x > 80:\n        return "B"\n', ""),
    }


def test_remove_assignment():
    src = dedent("""
        def f(x):
            y: int = x * 2
            y += 1
            return y


        class C:
            def __init__(self):
                self.x = 1
    """)
    assert sources(src, "remove_assignment") == {
        src.replace("    y: int = x * 2\n", ""),
        src.replace("    y += 1\n", ""),
        src.replace("        self.x = 1\n", "        pass\n"),
    }


def test_remove_loop():
    src = dedent("""
        def total(xs):
            s = 0
            for x in xs:
                s += x
            else:
                s -= 1
            return s


        def spin(n):
            while n:
                n -= 1
    """)
    assert sources(src, "remove_loop") == {
        src.replace("    for x in xs:\n        s += x\n    else:\n        s -= 1\n", ""),
        src.replace("    while n:\n        n -= 1\n", "    pass\n"),
    }


def test_remove_with_try():
    src = dedent('''
        def read(path):
            try:
                with open(path) as f:
                    text = f.read()
                    doc = """a
          b"""
            except OSError:
                return None
            finally:
                print("done")
            return text
    ''')
    unwrapped_try = dedent('''
        def read(path):
            with open(path) as f:
                text = f.read()
                doc = """a
          b"""
            return text
    ''')
    unwrapped_with = src.replace("        with open(path) as f:\n            text", "        text").replace(
        '            doc = """a', '        doc = """a'
    )
    assert sources(src, "remove_with_try") == {unwrapped_try, unwrapped_with}


def test_shuffle_statements():
    src = dedent("""
        def area(w, h):
            w = abs(w)
            a = w * h
            return a


        def independent():
            x = 1
            y = 2
            return x + y
    """)
    assert sources(src, "shuffle_statements", range(5)) == {
        src.replace("    w = abs(w)\n    a = w * h\n", "    a = w * h\n    w = abs(w)\n")
    }


def test_remove_method():
    src = dedent("""
        class Stack(list):
            \"\"\"A stack.\"\"\"

            def push(self, x):
                self.append(x)

            @property
            def top(self):
                return self[-1]


        class Only:
            def __init__(self):
                self.x = 1
    """)
    assert sources(src, "remove_method") == {
        src.replace("    def push(self, x):\n        self.append(x)\n", ""),
        src.replace("    @property\n    def top(self):\n        return self[-1]\n", ""),
    }
    (m,) = [m for m in mutations(src, kinds=["remove_method"]) if "push" in m.description]
    assert (m.function, m.line) == ("Stack", 4)


def test_remove_base():
    src = dedent("""
        class A(Base, Mixin, metaclass=Meta):
            pass


        class B(Base):
            pass


        class C(object):
            pass
    """)
    assert sources(src, "remove_base", range(20)) == {
        src.replace("class A(Base, Mixin, metaclass=Meta)", "class A(Mixin, metaclass=Meta)"),
        src.replace("class A(Base, Mixin, metaclass=Meta)", "class A(Base, metaclass=Meta)"),
        src.replace("class B(Base):", "class B:"),
    }


def test_every_kind_has_a_crafted_test():
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert set(KINDS) <= tested


# -- positions, protected regions, attribution ------------------------------------------------------------------


def test_non_ascii_columns_are_utf8_byte_offsets():
    src = dedent("""
        def greet(name, n, s):
            if "🙂" in s and n < 3:
                return "héllo wörld ✓ " + name * (n - 1)
            return s
    """)
    out = {m.source for m in mutations(src, per_function=100)}
    assert src.replace("name * (n - 1)", "name * (n + 1)") in out
    assert {src.replace("name * (n - 1)", "name // (n - 1)"), src.replace("name * (n - 1)", "name / (n - 1)")} & out
    assert src.replace("name * (n - 1)", "name * 1") in out
    assert src.replace("n < 3", "n > 3") in out
    assert src.replace('"🙂" in s', '"🙂" not in s') in out
    assert src.replace('"🙂" in s and n < 3', '"🙂" in s or n < 3') in out
    assert src.replace("(n - 1)", "(1 - n)") in out
    assert all(changed_lines(src, s) <= 4 for s in out)


def test_crlf_line_endings_are_kept():
    src = dedent("""
        def f(xs):
            total = 0
            for x in xs:
                if x > 0:
                    total += x
                else:
                    total -= 1
            return total
    """).replace("\n", "\r\n")
    found = mutations(src, per_function=100)
    assert len(found) >= 8
    for m in found:
        ast.parse(m.source)
        assert m.source.count("\n") == m.source.count("\r\n")


def test_protected_regions_are_never_mutated():
    src = dedent('''
        """Module doc 1 + 2."""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            def typed(x: int = 1 + 2) -> int: ...
        X = 1 + 2
        __all__ = ["f"]
        @decorator(3 - 1)
        def f(a: int = 5 - 1, *, b: "list[int]" = [1, 2]) -> int:
            """Doc with 1 + 2 and x < y."""
            c: int = a + 1
            return c + f"{a + 1}"
        if __name__ == "__main__":
            print(f(1 + 2))
    ''')
    found = mutations(src, per_function=100)
    assert {m.kind for m in found} == {"constant_shift", "swap_operator", "remove_assignment", "swap_operands"}
    for m in found:
        assert m.function == "f"
        assert touched(src, m.source) <= {10, 11}, m.description  # the two body lines after the docstring
        assert 'f"{a + 1}"' in m.source


def test_nested_functions_are_attributed_to_the_innermost_def():
    src = dedent("""
        def outer(n):
            def inner(x):
                return x + n
            return inner(n) * 2
    """)
    by_function = {m.function: m for m in mutations(src, kinds=["swap_operator"])}
    assert set(by_function) == {"outer", "outer.inner"}
    assert by_function["outer.inner"].line == 3
    assert by_function["outer.inner"].description == "changed `+` to `-` in outer.inner (line 3)"
    assert by_function["outer"].line == 4
    assert by_function["outer"].source in {src.replace("* 2", "// 2"), src.replace("* 2", "/ 2")}


def test_bindings_of_nonlocal_names_are_kept():
    src = dedent("""
        def counter(step):
            count = 0
            def bump():
                nonlocal count
                count += step
                return count
            return bump
    """)
    assert sources(src, "remove_assignment") == set()
    for m in mutations(src, per_function=100):
        compile(m.source, "<mutated>", "exec")


def test_kinds_filter_and_cap():
    src = STDLIB["textwrap"]
    only = mutations(src, kinds=["flip_comparison"])
    assert only and {m.kind for m in only} == {"flip_comparison"}
    for cap in (1, 2):
        counts = Counter(m.function for m in mutations(src, per_function=cap))
        assert max(counts.values()) == cap
    with pytest.raises(ValueError, match="unknown mutation kinds"):
        mutations(src, kinds=["swap_operator", "delete_everything"])


# -- real modules ---------------------------------------------------------------------------------------------


def docstring_lines(tree: ast.Module, length: int) -> list[tuple[set[int], set[int]]]:
    """(docstring lines, lines of its module/class/def) for every docstring."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and type(first.value.value) is str:
                whole = isinstance(node, ast.Module)
                owner = range(1, length + 1) if whole else range(_first_line(node), node.end_lineno + 1)
                out.append((set(range(first.lineno, first.end_lineno + 1)), set(owner)))
    return out


def touched(a: str, b: str) -> set[int]:
    """Lines of ``a`` that ``b`` replaces or deletes."""
    return {i for tag, i1, i2, _, _ in diff_ops(a, b) if tag in ("replace", "delete") for i in range(i1, i2)}


def units(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """Defs and classes with their qualified names."""
    return list(_walk_units(tree, ""))


def _first_line(node: ast.AST) -> int:
    return node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno


def unit_of(defs: list[tuple[str, ast.AST]], m: Mutation) -> ast.AST:
    """The def/class a mutation names (qualified names can repeat, e.g. a def per ``if`` branch: the line decides)."""
    (node,) = [node for name, node in defs if name == m.function and _first_line(node) <= m.line <= node.end_lineno]
    return node


def _walk_units(node: ast.AST, prefix: str):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield prefix + child.name, child
            yield from _walk_units(child, f"{prefix}{child.name}.")
        else:
            yield from _walk_units(child, prefix)


def score(unit: ast.AST) -> int:
    """The cyclomatic-like score of a def/class body, nested defs and classes excluded."""
    branches = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith, ast.BoolOp)
    branches += (ast.comprehension, ast.Match)
    total, stack = 1, list(unit.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.JoinedStr):
            continue
        total += isinstance(node, branches)
        stack.extend(ast.iter_child_nodes(node))
    return total


@pytest.mark.parametrize("name", sorted(STDLIB))
def test_stdlib_invariants(name):
    src = STDLIB[name]
    tree = ast.parse(src)
    defs, docs = units(tree), docstring_lines(tree, len(src.splitlines()))
    main = [ast.get_source_segment(src, n) for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.dump(n)]
    found = mutations(src)
    assert len(found) >= 10
    assert len({m.source for m in found}) == len(found)
    for m in found:
        assert isinstance(m, Mutation) and m.kind in KINDS
        compile(m.source, name, "exec", dont_inherit=True)  # parses, and is a valid module (no symtable errors)
        assert m.source != src
        unit = unit_of(defs, m)
        assert m.description.endswith(f" in {m.function} (line {m.line})")
        bound = 12
        if m.kind in SPAN_KINDS:
            (node,) = [n for n in ast.walk(unit) if isinstance(n, SPAN_KINDS[m.kind]) and n.lineno == m.line]
            bound = 2 * (node.end_lineno - _first_line(node) + 1)
        assert 0 < changed_lines(src, m.source) <= bound, m.description
        gone = touched(src, m.source)
        for doc, owner in docs:  # a docstring only changes when its whole def goes
            assert not doc & gone or owner <= gone, m.description
        assert all(block in m.source for block in main)
    assert mutations(src, seed=7) == mutations(src, seed=7)


def test_ranking_puts_the_most_complex_functions_first():
    src = STDLIB["functools"]
    defs = units(ast.parse(src))
    found = mutations(src)
    scores = [score(unit_of(defs, m)) for m in found]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] == max(score(node) for _, node in defs)
    assert mutations(src, seed=0) != mutations(src, seed=1)


def test_all_kinds_occur_in_real_code():
    found = {m.kind for src in STDLIB.values() for m in mutations(src, per_function=100)}
    assert found == set(KINDS)


def test_a_thousand_line_module_is_fast():
    src = STDLIB["functools"]
    assert len(src.splitlines()) >= 1000
    start = time.perf_counter()
    found = mutations(src)
    assert time.perf_counter() - start < 1.0
    assert len(found) > 50


# -- behaviour --------------------------------------------------------------------------------------------------

BEHAVIOUR = dedent("""
    def clamp(x, lo, hi):
        if x < lo:
            return lo
        if x > hi:
            return hi
        return x


    def mean(xs):
        if not xs:
            raise ValueError("empty")
        total = 0
        for x in xs:
            total += x
        return total / len(xs)


    def find_index(items, target):
        for i, item in enumerate(items):
            if item == target:
                return i
        return -1


    def running_max(xs):
        best = None
        out = []
        for x in xs:
            if best is None or x > best:
                best = x
            out.append(best)
        return out


    def rle(text):
        runs = []
        for ch in text:
            if runs and runs[-1][0] == ch:
                runs[-1][1] += 1
            else:
                runs.append([ch, 1])
        return runs


    class Counter:
        def __init__(self, start=0):
            self.n = start

        def step(self, k):
            self.n = self.n * 2 + k
            return self.n
""")
PROBES = [
    ("clamp", (-5, 0, 10)),
    ("clamp", (5, 0, 10)),
    ("clamp", (15, 0, 10)),
    ("clamp", (0, 0, 10)),
    ("clamp", (10, 0, 10)),
    ("mean", ([1, 2, 3, 6],)),
    ("mean", ([],)),
    ("mean", ([5],)),
    ("find_index", ([3, 1, 4], 4)),
    ("find_index", ([3, 1, 4], 9)),
    ("find_index", ([], 1)),
    ("running_max", ([3, 1, 4, 1, 5],)),
    ("running_max", ([],)),
    ("rle", ("aaabcc",)),
    ("rle", ("",)),
]


def observe(src: str) -> list[str]:
    namespace: dict = {}
    exec(compile(src, "<mutated>", "exec"), namespace)
    results = []
    for name, args in PROBES:
        try:
            results.append(repr(namespace[name](*args)))
        except Exception as exc:
            results.append(type(exc).__name__)
    try:
        counter = namespace["Counter"](1)
        results.append(repr([counter.step(1), counter.step(3)]))
    except Exception as exc:
        results.append(type(exc).__name__)
    return results


@pytest.mark.parametrize("per_function", [3, 100])
def test_mutations_change_behaviour(per_function):
    baseline = observe(BEHAVIOUR)
    found = mutations(BEHAVIOUR, per_function=per_function)
    assert len(found) >= 15
    changed = [m for m in found if observe(m.source) != baseline]
    assert len(changed) / len(found) >= 0.6, [m.description for m in found if m not in changed]
