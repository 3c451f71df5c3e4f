"""Procedural bug mutations of one Python module's source (SWE-smith's procedural method, standard-library ``ast``).

Nodes are located with ``ast`` and only their source span is replaced, so comments, formatting and every other line
stay byte-identical. Only code inside functions and classes is mutated: module-level statements (``__all__``,
``if __name__ == "__main__":``), docstrings, ``if TYPE_CHECKING:`` blocks, annotations, signatures (defaults
included), decorators and f-strings are never touched. ``remove_condition`` deletes the whole ``if`` (guard and
body), ``remove_with_try`` keeps the ``try`` body only (handlers, ``else`` and ``finally`` go), and
``shuffle_statements`` only reorders statements where one writes a name another uses, so the order matters.
Every candidate is re-parsed (just its enclosing def or class) before it is returned.
"""

from __future__ import annotations

import ast
import io
import random
import re
import tokenize
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise

KINDS: tuple[str, ...] = (
    "swap_operator",
    "flip_comparison",
    "flip_bool_op",
    "swap_operands",
    "break_chain",
    "constant_shift",
    "invert_if",
    "remove_condition",
    "remove_assignment",
    "remove_loop",
    "remove_with_try",
    "shuffle_statements",
    "remove_method",
    "remove_base",
)

_NEWLINE = re.compile(r"\r\n|\r|\n")
_BIN_TOKENS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
_BIN_TOKENS |= {ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>"}
_BIN_SWAPS = {"+": ("-",), "-": ("+",), "*": ("//", "/"), "//": ("*", "%"), "%": ("//", "*"), "/": ("*",)}
_BIN_SWAPS |= {"&": ("|", "^"), "|": ("&", "^"), "^": ("&", "|"), "<<": (">>",), ">>": ("<<",)}
_CMP_TOKENS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.Gt: ">", ast.LtE: "<=", ast.GtE: ">="}
_CMP_TOKENS |= {ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_CMP_FLIPS = {"==": "!=", "!=": "==", "<": ">", ">": "<", "<=": ">=", ">=": "<="}
_CMP_FLIPS |= {"in": "not in", "not in": "in", "is": "is not", "is not": "is"}
_ORDERED = (ast.Lt, ast.Gt, ast.LtE, ast.GtE)
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift, ast.MatMult)
_PRECEDENCE = {ast.BitOr: 1, ast.BitXor: 2, ast.BitAnd: 3, ast.LShift: 4, ast.RShift: 4, ast.Add: 5, ast.Sub: 5}
_PRECEDENCE |= {ast.Mult: 6, ast.Div: 6, ast.FloorDiv: 6, ast.Mod: 6, ast.MatMult: 6, ast.Pow: 8}
_STRING_TOKENS = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_BRANCHES = (
    *(ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.TryStar, ast.With, ast.AsyncWith),
    *(ast.BoolOp, ast.comprehension, ast.Match),
)
_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Delete, ast.Assert)
_SKIP_FIELDS = {ast.AnnAssign: {"annotation"}, ast.Lambda: {"args"}}
# Node types each node-level kind applies to (shuffle_statements works on blocks, remove_base on classes).
_TARGETS = {
    "swap_operator": (ast.BinOp, ast.AugAssign),
    "flip_comparison": (ast.Compare,),
    "flip_bool_op": (ast.BoolOp,),
    "swap_operands": (ast.BinOp, ast.Compare),
    "break_chain": (ast.BinOp, ast.Compare, ast.BoolOp),
    "constant_shift": (ast.Constant,),
    "invert_if": (ast.If,),
    "remove_condition": (ast.If,),
    "remove_assignment": (ast.Assign, ast.AugAssign, ast.AnnAssign),
    "remove_loop": (ast.For, ast.AsyncFor, ast.While),
    "remove_with_try": (ast.With, ast.AsyncWith, ast.Try, ast.TryStar),
    "remove_method": _DEFS,
}
_KINDS_BY_TYPE: dict[type[ast.AST], list[str]] = {
    t: [kind for kind, types in _TARGETS.items() if t in types] for ts in _TARGETS.values() for t in ts
}


@dataclass(frozen=True)
class Mutation:
    """One candidate bug: the whole mutated module, and what changed where."""

    kind: str  # one of KINDS
    function: str  # qualified name of the enclosing def/class, e.g. "LRUCache.popitem"
    line: int  # 1-based line of the changed node in the original source
    source: str  # the whole mutated module text
    description: str  # e.g. "changed `<` to `>` in LRUCache.popitem (line 42)"


@dataclass(frozen=True)
class _Change:
    start: int  # str offsets into the original source
    end: int
    text: str
    line: int
    what: str


@dataclass(eq=False)
class _Unit:
    """A def or class: mutations are attributed to, capped and ranked per unit."""

    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    parent: _Unit | None
    order: int
    score: int = 1
    nodes: list[ast.AST] = field(default_factory=list)
    blocks: list[list[ast.stmt]] = field(default_factory=list)


def _short(text: str, width: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


_Located = ast.stmt | ast.expr | ast.keyword
"""A node with a source position."""


def _end(node: _Located) -> tuple[int, int]:
    """A parsed node's end (line, column): ``ast.parse`` sets both; the type stubs allow None."""
    if node.end_lineno is None or node.end_col_offset is None:
        raise ValueError(f"{type(node).__name__} at line {node.lineno} has no end position")
    return node.end_lineno, node.end_col_offset


def _last_line(node: _Located) -> int:
    return _end(node)[0]


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", None)
    return decorators[0].lineno if decorators else node.lineno


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _is_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` or ``if TYPE_CHECKING:``."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    if isinstance(test, ast.Name | ast.Attribute):
        return (test.id if isinstance(test, ast.Name) else test.attr) == "TYPE_CHECKING"
    if isinstance(test, ast.Compare) and len(test.comparators) == 1:
        sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
        return sides == {"__name__", "'__main__'"}
    return False


def _is_texty(node: ast.expr) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str | bytes))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def _written(target: ast.expr) -> Iterator[str]:
    """The names an assignment target writes: ``a``, ``self.a``; ``a`` for ``a[i] = ...``."""
    if isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _written(element)
    elif isinstance(target, ast.Starred | ast.Subscript):
        yield from _written(target.value)
    elif name := _dotted(target):
        yield name


def _effects(stmt: ast.stmt) -> tuple[set[str], set[str]]:
    """Names a simple statement writes (targets, receivers of method calls) and all names it mentions."""
    uses = {name for n in ast.walk(stmt) if (name := _dotted(n))}
    if isinstance(stmt, ast.Expr):  # bare expressions have side effects: their relative order matters
        call = stmt.value
        receiver = call.func.value if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) else None
        return {"()", *(_written(receiver) if receiver else ())}, uses | {"()"}
    targets = getattr(stmt, "targets", None) or [getattr(stmt, "target", None)]
    return {name for target in targets if target for name in _written(target)}, uses


def _dependent(window: list[ast.stmt]) -> bool:
    effects = [_effects(s) for s in window]
    return any(i != j and wi & uj for i, (wi, _) in enumerate(effects) for j, (_, uj) in enumerate(effects))


class _Module:
    """One module's text and tree: collects units, generates and validates candidate changes."""

    def __init__(self, source: str) -> None:
        self.s = source
        self.starts = [0, *(m.end() for m in _NEWLINE.finditer(source))]  # ast numbers lines like this
        self.units: list[_Unit] = []
        self.block_of: dict[int, list[ast.stmt]] = {}
        self.docstrings: set[int] = set()
        self.elifs: set[int] = set()
        self.method_class: dict[int, ast.ClassDef] = {}
        self.nonlocals: set[str] = set()  # an inner `nonlocal x` needs the binding of x to stay
        self._block(ast.parse(source).body, None, docstring=True)

    # -- text positions ---------------------------------------------------------------------------------------
    def bol(self, lineno: int) -> int:
        return self.starts[lineno - 1] if lineno <= len(self.starts) else len(self.s)

    def line(self, lineno: int) -> str:
        return self.s[self.bol(lineno) : self.bol(lineno + 1)]

    def lines(self, first: int, last: int) -> str:
        """Lines ``first..last`` with their terminators (one is added at a file end without one)."""
        text = self.s[self.bol(first) : self.bol(last + 1)]
        return text + "\n" if text and not text.endswith(("\n", "\r")) else text

    def indent(self, lineno: int) -> str:
        line = self.line(lineno)
        return line[: len(line) - len(line.lstrip(" \t\f"))]

    def offset(self, lineno: int, col: int) -> int:
        """The str offset of ``ast``'s (line, UTF-8 byte column) position."""
        line = self.line(lineno)
        return self.bol(lineno) + (col if line.isascii() else len(line.encode()[:col].decode(errors="replace")))

    def start(self, node: _Located) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: _Located) -> int:
        return self.offset(*_end(node))

    def seg(self, node: _Located) -> str:
        return self.s[self.start(node) : self.end(node)]

    def starts_line(self, node: ast.stmt) -> bool:
        return not self.s[self.bol(node.lineno) : self.start(node)].strip()

    def owns_lines(self, node: ast.stmt) -> bool:
        """Whether the statement alone occupies its lines (a trailing comment allowed)."""
        tail = self.s[self.end(node) : self.bol(_last_line(node) + 1)].strip()
        return self.starts_line(node) and (not tail or tail.startswith("#"))

    def skip(self, i: int, end: int) -> int:
        """The first offset from ``i`` that is not whitespace, a bracket, a line continuation or a comment."""
        while i < end:
            if self.s[i] == "#":
                newline = self.s.find("\n", i, end)
                i = end if newline < 0 else newline
            elif self.s[i] in " \t\f\r\n\\()":
                i += 1
            else:
                break
        return i

    def token(self, start: int, end: int, words: str) -> tuple[int, int] | None:
        """The span of operator ``words`` (e.g. ``"not in"``) when it is the first token of ``s[start:end]``."""
        i = first = self.skip(start, end)
        for word in words.split():
            i = self.skip(i, end)
            if not self.s.startswith(word, i):
                return None
            i += len(word)
        return first, i

    # -- collection -------------------------------------------------------------------------------------------
    def _block(self, body: list[ast.stmt], unit: _Unit | None, docstring: bool) -> None:
        for i, stmt in enumerate(body):
            self.block_of[id(stmt)] = body
            if docstring and i == 0 and _is_docstring(stmt):
                self.docstrings.add(id(stmt))
            else:
                self._visit(stmt, unit)
        if unit is not None:
            unit.blocks.append(body)

    def _visit(self, node: ast.AST, unit: _Unit | None) -> None:
        if _is_guard(node) or isinstance(node, ast.JoinedStr):
            return
        if isinstance(node, ast.Nonlocal):
            self.nonlocals.update(node.names)
        if isinstance(node, (*_DEFS, ast.ClassDef)):
            if unit is not None and isinstance(unit.node, ast.ClassDef) and isinstance(node, _DEFS):
                unit.nodes.append(node)  # a method: remove_method's target
                self.method_class[id(node)] = unit.node
            qualname = f"{unit.qualname}.{node.name}" if unit else node.name
            child = _Unit(qualname, node, unit, len(self.units))
            self.units.append(child)
            self._block(node.body, child, docstring=True)
            return
        if unit is not None:
            unit.score += isinstance(node, _BRANCHES)
            if type(node) in _KINDS_BY_TYPE:
                unit.nodes.append(node)
        orelse = node.orelse if isinstance(node, ast.If) else []
        if len(orelse) == 1 and isinstance(orelse[0], ast.If) and self.s.startswith("elif", self.start(orelse[0])):
            self.elifs.add(id(orelse[0]))
        skip = _SKIP_FIELDS.get(type(node), ())
        for name, value in ast.iter_fields(node):
            if name in skip:
                continue
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self._block(value, unit, docstring=False)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self._visit(item, unit)
            elif isinstance(value, ast.AST):
                self._visit(value, unit)

    # -- shared edits -----------------------------------------------------------------------------------------
    def op_spans(self, node: ast.BinOp | ast.AugAssign | ast.Compare | ast.BoolOp) -> list[tuple[int, int]] | None:
        """The spans of the operator tokens between the operands, in order (None where one is not found)."""
        if isinstance(node, ast.BinOp):
            parts, ops = [node.left, node.right], [_BIN_TOKENS[type(node.op)]]
        elif isinstance(node, ast.AugAssign):
            parts, ops = [node.target, node.value], [_BIN_TOKENS[type(node.op)] + "="]
        elif isinstance(node, ast.Compare):
            parts, ops = [node.left, *node.comparators], [_CMP_TOKENS[type(op)] for op in node.ops]
        else:
            parts, ops = node.values, ["and" if isinstance(node.op, ast.And) else "or"] * (len(node.values) - 1)
        spans = [self.token(self.end(a), self.start(b), op) for (a, b), op in zip(pairwise(parts), ops, strict=True)]
        found = [span for span in spans if span is not None]
        return found if len(found) == len(spans) else None

    def left_end(self, child: ast.expr, op_start: int) -> int:
        """Where a left operand ends, its closing parentheses included."""
        return max(self.end(child), self.s.rfind(")", self.end(child), op_start) + 1)

    def right_start(self, child: ast.expr, op_end: int) -> int:
        """Where a right operand starts, its opening parentheses included."""
        paren = self.s.find("(", op_end, self.start(child))
        return self.start(child) if paren < 0 else paren

    def operand(self, child: ast.expr, start: int, end: int, op: ast.operator | None, right: bool) -> str:
        """An operand's text ``s[start:end]`` for the ``right`` (or left) side of binary ``op`` (None: a comparison),
        parenthesized where precedence needs it."""
        text = self.s[start:end]
        if op is None or text != self.seg(child):  # a comparison's operands bind tighter; parenthesized already
            return text
        if isinstance(child, ast.BinOp):
            inner = _PRECEDENCE[type(child.op)]
        elif isinstance(child, ast.UnaryOp | ast.BoolOp | ast.Compare | ast.IfExp | ast.Lambda | ast.NamedExpr):
            inner = 7 if isinstance(child, ast.UnaryOp) else 0
        else:
            return text
        outer = _PRECEDENCE[type(op)]
        tie = right != isinstance(op, ast.Pow)  # the side where equal precedence regroups
        return f"({text})" if inner < outer or (inner == outer and tie) else text

    def _delete(self, node: ast.stmt, what: str) -> _Change | None:
        """Delete a statement's lines; the only statement of a block becomes ``pass`` (an ``elif`` just goes)."""
        only = len(self.block_of[id(node)]) == 1 and id(node) not in self.elifs
        if self.owns_lines(node):
            first, last = _first_line(node), _last_line(node)
            line = self.line(first)
            text = self.indent(first) + "pass" + (line[len(line.rstrip("\r\n")) :] or "\n") if only else ""
            return _Change(self.bol(first), self.bol(last + 1), text, node.lineno, what)
        return _Change(self.start(node), self.end(node), "pass", node.lineno, what) if only else None

    def _unwrap(self, node: ast.stmt, body: list[ast.stmt], what: str) -> _Change | None:
        """Replace a compound statement by its ``body``, dedented one level (multi-line string lines kept)."""
        if not (self.owns_lines(node) and self.starts_line(body[0])):
            return None
        first, last = _first_line(body[0]), _last_line(body[-1])
        outer, inner = self.indent(node.lineno), self.indent(first)
        if len(inner) <= len(outer) or not inner.startswith(outer):
            return None
        keep = self.string_lines(first, last)
        if keep is None:
            return None
        dedented = []
        for n in range(first, last + 1):
            line = self.line(n)
            dedented.append(outer + line[len(inner) :] if n not in keep and line.startswith(inner) else line)
        text = "".join(dedented)
        text += "" if text.endswith(("\n", "\r")) else "\n"
        return _Change(self.bol(node.lineno), self.bol(_last_line(node) + 1), text, node.lineno, what)

    def string_lines(self, first: int, last: int) -> set[int] | None:
        """Lines ``first..last`` that continue a multi-line string (text, not indentation); None if untokenizable."""
        lines = io.StringIO(self.s[self.bol(first) : self.bol(last + 1)]).readline
        inside: set[int] = set()
        try:
            for token in tokenize.generate_tokens(lines):
                if token.type in _STRING_TOKENS:
                    inside.update(range(first + token.start[0], first + token.end[0]))
        except (tokenize.TokenError, SyntaxError):
            return None
        return inside

    # -- kinds: each returns a change or None when the node does not qualify ----------------------------------
    def swap_operator(self, node: ast.BinOp | ast.AugAssign, rng: random.Random) -> _Change | None:
        if isinstance(node, ast.BinOp) and (_is_texty(node.left) or _is_texty(node.right)):
            return None
        old = _BIN_TOKENS[type(node.op)]
        spans = old in _BIN_SWAPS and self.op_spans(node)
        if not spans:
            return None
        suffix = "=" if isinstance(node, ast.AugAssign) else ""
        new = rng.choice(_BIN_SWAPS[old]) + suffix
        return _Change(*spans[0], new, node.lineno, f"changed `{old}{suffix}` to `{new}`")

    def flip_comparison(self, node: ast.Compare, rng: random.Random) -> _Change | None:
        i = rng.randrange(len(node.ops))
        old = _CMP_TOKENS[type(node.ops[i])]
        spans = self.op_spans(node)
        if not spans:
            return None
        return _Change(*spans[i], _CMP_FLIPS[old], node.lineno, f"changed `{old}` to `{_CMP_FLIPS[old]}`")

    def flip_bool_op(self, node: ast.BoolOp, rng: random.Random) -> _Change | None:
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        spans = self.op_spans(node)
        if not spans:
            return None
        start, end = self.start(node), self.end(node)
        text = self.s[start:end]
        for a, b in reversed(spans):
            text = text[: a - start] + new + text[b - start :]
        return _Change(start, end, text, node.lineno, f"changed `{old}` to `{new}`")

    def swap_operands(self, node: ast.BinOp | ast.Compare, rng: random.Random) -> _Change | None:
        if isinstance(node, ast.Compare):
            if len(node.ops) > 1 or not isinstance(node.ops[0], _ORDERED):
                return None
            left, right = node.left, node.comparators[0]
        else:
            left, right = node.left, node.right
            sequence = any(_is_texty(x) or isinstance(x, ast.List | ast.Tuple | ast.ListComp) for x in (left, right))
            if not ((isinstance(node.op, ast.Add) and sequence) or isinstance(node.op, _NON_COMMUTATIVE)):
                return None
            if not isinstance(node.op, ast.Add) and (_is_texty(left) or _is_texty(right)):
                return None
        spans = self.op_spans(node)
        if not spans:
            return None
        start, end, op = self.start(node), self.end(node), getattr(node, "op", None)
        mid_start, mid_end = self.left_end(left, spans[0][0]), self.right_start(right, spans[0][1])
        text = self.operand(right, mid_end, end, op, right=False) + self.s[mid_start:mid_end]
        text += self.operand(left, start, mid_start, op, right=True)
        return _Change(start, end, text, node.lineno, f"swapped the operands of `{_short(self.seg(node))}`")

    def break_chain(self, node: ast.BinOp | ast.Compare | ast.BoolOp, rng: random.Random) -> _Change | None:
        """``a op b op c`` (also ``(a op b) op c``, ``a op (b op c)``) -> ``a op c``."""
        spans = self.op_spans(node)
        if not spans:
            return None
        start, end = self.start(node), self.end(node)
        options: list[tuple[ast.expr, str]] = []  # (dropped operand, new text)
        if isinstance(node, ast.BinOp):
            left, right = node.left, node.right
            if isinstance(left, ast.BinOp) and (inner := self.op_spans(left)):
                keep_end = self.left_end(left.left, inner[0][0])
                keep = self.operand(left.left, self.start(left), keep_end, node.op, right=False)
                options.append((left.right, keep + self.s[self.left_end(left, spans[0][0]) : end]))
            if isinstance(right, ast.BinOp) and (inner := self.op_spans(right)):
                keep_start = self.right_start(right.right, inner[0][1])
                keep = self.operand(right.right, keep_start, self.end(right), node.op, right=True)
                options.append((right.left, self.s[start : self.right_start(right, spans[0][1])] + keep))
        else:
            values = [node.left, *node.comparators] if isinstance(node, ast.Compare) else node.values
            for j in range(1, len(values) - 1):  # delete operand j and the operator after it
                text = self.s[start : spans[j - 1][1]] + self.s[spans[j][1] : end]
                options.append((values[j], text))
        if not options:
            return None
        dropped, text = rng.choice(options)
        what = f"dropped `{_short(self.seg(dropped))}` from `{_short(self.seg(node))}`"
        return _Change(start, end, text, node.lineno, what)

    def constant_shift(self, node: ast.Constant, rng: random.Random) -> _Change | None:
        if type(node.value) is not int:
            return None
        new = node.value + rng.choice((1, -1))
        what = f"changed `{self.seg(node)}` to `{new}`"
        return _Change(self.start(node), self.end(node), str(new), node.lineno, what)

    def invert_if(self, node: ast.If, rng: random.Random) -> _Change | None:
        body, other = node.body, node.orelse
        if not other or id(other[0]) in self.elifs:
            return None
        if not (self.owns_lines(node) and self.starts_line(body[0]) and self.starts_line(other[0])):
            return None
        b0, b1, e0, e1 = _first_line(body[0]), _last_line(body[-1]), _first_line(other[0]), _last_line(other[-1])
        if self.indent(b0) != self.indent(e0):
            return None
        text = self.lines(e0, e1) + self.lines(b1 + 1, e0 - 1) + self.lines(b0, b1)
        what = f"swapped the branches of `if {_short(self.seg(node.test))}`"
        return _Change(self.bol(b0), self.bol(e1 + 1), text, node.lineno, what)

    def remove_condition(self, node: ast.If, rng: random.Random) -> _Change | None:
        return None if node.orelse else self._delete(node, f"removed `if {_short(self.seg(node.test))}` and its body")

    def remove_assignment(self, node: ast.Assign | ast.AugAssign | ast.AnnAssign, rng: random.Random) -> _Change | None:
        if isinstance(node, ast.AnnAssign) and node.value is None:
            return None
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(n, ast.Name) and n.id in self.nonlocals for t in targets for n in ast.walk(t)):
            return None
        return self._delete(node, f"removed `{_short(self.seg(node))}`")

    def remove_loop(self, node: ast.For | ast.AsyncFor | ast.While, rng: random.Random) -> _Change | None:
        return self._delete(node, f"removed the loop `{_short(self.line(node.lineno))}`")

    def remove_with_try(self, node: ast.With | ast.AsyncWith | ast.Try, rng: random.Random) -> _Change | None:
        return self._unwrap(node, node.body, f"kept only the body of `{_short(self.line(node.lineno))}`")

    def shuffle_statements(self, block: list[ast.stmt], rng: random.Random) -> _Change | None:
        runs: list[list[ast.stmt]] = [[]]
        for stmt in block:
            simple = isinstance(stmt, _SIMPLE) and id(stmt) not in self.docstrings and self.owns_lines(stmt)
            if simple:
                runs[-1].append(stmt)
            elif runs[-1]:
                runs.append([])
        windows = [run[i : i + k] for run in runs for k in (2, 3) for i in range(len(run) - k + 1)]
        windows = [w for w in windows if _dependent(w)]
        if not windows:
            return None
        window = rng.choice(windows)
        order = window[:]
        while order == window:
            rng.shuffle(order)
        gaps = [self.lines(_last_line(a) + 1, _first_line(b) - 1) for a, b in pairwise(window)]
        chunks = [self.lines(_first_line(s), _last_line(s)) for s in order]
        text = "".join(c + g for c, g in zip(chunks, [*gaps, ""], strict=True))
        first, last = _first_line(window[0]), _last_line(window[-1])
        return _Change(self.bol(first), self.bol(last + 1), text, first, f"reordered lines {first}-{last}")

    def remove_method(self, node: ast.FunctionDef | ast.AsyncFunctionDef, rng: random.Random) -> _Change | None:
        cls = self.method_class.get(id(node))
        if cls is None:
            return None
        if node.name == "__init__" and sum(isinstance(s, _DEFS) for s in cls.body) == 1:
            return None
        return self._delete(node, f"removed method `{node.name}`")

    def remove_base(self, node: ast.ClassDef, rng: random.Random) -> _Change | None:
        bases = [b for b in node.bases if not (isinstance(b, ast.Name) and b.id == "object")]
        if not bases:
            return None
        base = rng.choice(bases)
        items: list[ast.expr | ast.keyword] = sorted(
            [*node.bases, *node.keywords], key=lambda n: (n.lineno, n.col_offset)
        )
        rest = [self.seg(item) for item in items if item is not base]
        start, end = self.start(items[0]), self.end(items[-1])
        if not rest:  # drop the parentheses too: `class A:`
            colon = self.skip(end, len(self.s))
            start, end = self.s.find("(", self.start(node)), self.s.rfind(")", end, colon) + 1
        return _Change(start, end, ", ".join(rest), base.lineno, f"removed base `{_short(self.seg(base))}`")

    # -- selection --------------------------------------------------------------------------------------------
    def _span(self, unit: _Unit | None) -> tuple[int, int, bool]:
        """What to re-parse for a change in ``unit``: the smallest enclosing def/class that owns its lines (under
        ``if 1:`` when indented), else the module: (start, end, indented)."""
        while unit is not None and not self.owns_lines(unit.node):
            unit = unit.parent
        if unit is None:
            return 0, len(self.s), False
        first = _first_line(unit.node)
        return self.bol(first), self.bol(_last_line(unit.node) + 1), bool(self.indent(first))

    def _parses(self, span: tuple[int, int, bool], change: _Change) -> bool:
        start, end, indented = span
        text = self.s[start : change.start] + change.text + self.s[change.end : end]
        try:
            ast.parse("if 1:\n" + text if indented else text)
        except (SyntaxError, ValueError):
            return False
        return True

    def pick(self, unit: _Unit, kinds: list[str], rng: random.Random, limit: int, seen: set[str]) -> list[Mutation]:
        """Up to ``limit`` valid, new mutations of one unit, round-robin over kinds in a seeded order."""
        targets: dict[str, list[ast.AST | list[ast.stmt]]] = {kind: [] for kind in kinds}
        for node in unit.nodes:
            for kind in _KINDS_BY_TYPE[type(node)]:
                if kind in targets:
                    targets[kind].append(node)
        if "shuffle_statements" in targets:
            targets["shuffle_statements"] = list(unit.blocks)
        if "remove_base" in targets and isinstance(unit.node, ast.ClassDef):
            targets["remove_base"] = [unit.node]
        queues = [[(kind, t) for t in ts] for kind, ts in targets.items() if ts]
        for queue in queues:
            rng.shuffle(queue)
        rng.shuffle(queues)
        streams = [self._valid(unit, queue, rng, seen) for queue in queues]
        out: list[Mutation] = []
        while streams and len(out) < limit:
            for stream in list(streams):
                if len(out) == limit:
                    break
                if (mutation := next(stream, None)) is None:
                    streams.remove(stream)
                else:
                    out.append(mutation)
        return out

    def _valid(
        self, unit: _Unit, queue: list[tuple[str, ast.AST | list[ast.stmt]]], rng: random.Random, seen: set[str]
    ) -> Iterator[Mutation]:
        """The queue's candidates that apply, re-parse and are new, as mutations (lazily: ``seen`` grows)."""
        span = self._span(unit)
        for kind, target in queue:
            change = getattr(self, kind)(target, rng)
            if change is None or change.text == self.s[change.start : change.end] or not self._parses(span, change):
                continue
            new = self.s[: change.start] + change.text + self.s[change.end :]
            if new in seen:
                continue
            seen.add(new)
            what = f"{change.what} in {unit.qualname} (line {change.line})"
            yield Mutation(kind, unit.qualname, change.line, new, what)


def mutations(
    source: str, *, seed: int = 0, per_function: int = 3, kinds: Iterable[str] | None = None
) -> list[Mutation]:
    """All candidate mutations of one module, most complex functions first; at most per_function per function/class.

    Units (defs and classes, nested ones included) are ranked by a cyclomatic-like score, ties in source order;
    ``seed`` varies which candidates a unit gets. Raises ``SyntaxError`` for a source that does not parse.
    """
    wanted = set(KINDS if kinds is None else kinds)
    if unknown := wanted - set(KINDS):
        raise ValueError(f"unknown mutation kinds: {sorted(unknown)}")
    with warnings.catch_warnings():  # invalid escapes and the like warn on every parse
        warnings.simplefilter("ignore")
        module = _Module(source)
        seen: set[str] = set()
        out: list[Mutation] = []
        for unit in sorted(module.units, key=lambda u: (-u.score, u.order)):
            rng = random.Random(f"{seed}:{unit.qualname}:{unit.node.lineno}")
            out += module.pick(unit, [k for k in KINDS if k in wanted], rng, per_function, seen)
    return out
