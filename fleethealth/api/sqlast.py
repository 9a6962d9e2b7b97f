"""The second gate in front of analyst SQL: ClickHouse's own parse, walked against allow-lists.

The lexer (:mod:`fleethealth.api.sqlgate`) guesses at what ClickHouse will read; this module
asks ClickHouse. The statement is parsed with ``EXPLAIN AST`` (the parser only: nothing is
executed, no function is called, no table is opened), and every node of the tree is checked:

* node types: only those of a plain ``SELECT`` (subqueries, unions, joins, ``WITH``, ``ORDER BY``,
  window specifications, literals …); a ``SETTINGS`` clause, an ``INTO OUTFILE``, a ``FORMAT`` or
  any node this module does not know is refused;
* functions: every ``Function`` node's name (in the select list, in ``REPLACE`` column
  transformers, in lambdas, anywhere in the tree), case-folded, must be in :data:`ALLOWED_FUNCTIONS`
  (or one of its prefix families, after stripping aggregate combinators such as ``If`` and
  ``State``). ``file``, ``url``, ``dictGet``, ``joinGet``, ``getSetting``, ``sleep``, ``hostName``
  and the like are simply not on the list;
* a node whose function the parse does not show is refused: ``* APPLY(f)`` prints as a bare
  ``ColumnsApplyTransformer`` (with ``file``, ``sleep`` or a lambda alike), so ``APPLY`` is refused
  in every form; a ``Function`` line without a name, or a name on a node type that should carry
  none, is refused too;
* table functions (a ``Function`` directly under a ``TableExpression``): only
  :data:`ALLOWED_TABLE_FUNCTIONS` (``numbers``, ``values`` …);
* tables: every ``TableIdentifier`` — and the right-hand side of ``IN`` when it names a table —
  must be one of the store's own tables (unqualified) or a name the statement defines with
  ``WITH name AS (SELECT …)``; no ``system.*``, no other database.

Names are only accepted when they print as plain identifiers, so a crafted alias or quoted
name cannot make one line of the tree read as another (the lexer already refuses quoted names
that are not plain identifiers, and anything outside ASCII outside string literals). Whatever
the walk cannot place — an unparsable line, a count of children that does not add up — is
refused: the gate only lets through what it can prove is a plain read of fleethealth's tables.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["ALLOWED_FUNCTIONS", "ALLOWED_TABLE_FUNCTIONS", "AstNode", "AstRefused", "parse_explain", "check_ast",
           "function_allowed", "parse_and_check"]

# Node types of a read-only SELECT as ClickHouse's EXPLAIN AST prints them.
_NODE_TYPES = frozenset({
    "SelectWithUnionQuery", "SelectIntersectExceptQuery", "SelectQuery", "ExpressionList", "Function",
    "Identifier", "Literal", "Asterisk", "QualifiedAsterisk", "ColumnsRegexpMatcher", "ColumnsListMatcher",
    "QualifiedColumnsRegexpMatcher", "QualifiedColumnsListMatcher", "ColumnsTransformerList",
    "ColumnsExceptTransformer", "ColumnsReplaceTransformer", "ColumnsReplaceTransformer::Replacement",
    "TablesInSelectQuery", "TablesInSelectQueryElement",
    "TableExpression", "TableIdentifier", "Subquery", "TableJoin", "ArrayJoin", "OrderByElement",
    "WithElement", "WindowDefinition", "WindowListElement", "Interval", "SampleRatio", "InterpolateElement",
    "WithFillElement", "LimitByClause",
})
"""Every other node type is refused, ``ColumnsApplyTransformer`` (``* APPLY(f)``) among them: the
parse prints it without the function it applies, so the gate cannot check that function."""

_NAMED = frozenset({"Function", "Identifier", "TableIdentifier", "Literal", "InterpolateElement", "SampleRatio"})
"""Node types whose line may carry a name after the type; on any other node a name is refused, so
a node type that starts printing something (a function, say) in a new release is not waved through."""

_UNSHOWN = {
    "ColumnsApplyTransformer": "the APPLY column transformer is not allowed: the parse does not show the "
                               "function it applies, so the gate cannot check it; call the function on "
                               "each column instead",
}

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LINE = re.compile(r"^(?P<indent> *)(?P<type>[A-Za-z]+(?:::[A-Za-z]+)*)(?P<rest>.*)$")
_CHILDREN = re.compile(r" \(children (?P<n>\d+)\)$")
_ALIAS = re.compile(r" \(alias (?P<alias>[A-Za-z_][A-Za-z0-9_]*)\)$")

ALLOWED_TABLE_FUNCTIONS = frozenset({"numbers", "generateseries", "generate_series", "values", "zeros", "one"})
"""Table functions that read nothing outside the query: sequences and inline values."""

_COMBINATORS = ("simplestate", "ordefault", "resample", "distinct", "foreach", "ornull", "argmin", "argmax",
                "state", "merge", "array", "tuple", "null", "map", "if")
"""Aggregate-function combinators (``sumIf``, ``quantileState``…), stripped to find the base name."""

ALLOWED_FUNCTIONS = frozenset(name.lower() for name in """
    and or not xor equals notEquals less greater lessOrEquals greaterOrEquals isNull isNotNull
    isNullable isNaN isFinite isInfinite isZeroOrNull plus minus multiply divide intDiv intDivOrZero modulo
    moduloOrZero negate abs gcd lcm sign sqrt cbrt exp exp2 exp10 log ln log2 log10 log1p pow power round
    roundBankers roundDown roundToExp2 floor ceil ceiling trunc truncate greatest least e pi sin cos tan asin
    acos atan atan2 sinh cosh tanh hypot erf erfc lgamma tgamma degrees radians
    if multiIf ifNull nullIf coalesce assumeNotNull toNullable isNotDistinctFrom
    in notIn globalIn globalNotIn nullIn notNullIn globalNullIn globalNotNullIn
    like notLike ilike notILike match
    lambda tuple tupleElement untuple array arrayElement map mapKeys mapValues mapContains
    cast _cast accurateCast accurateCastOrNull accurateCastOrDefault reinterpretAsString
    length empty notEmpty lengthUTF8 char ascii lower upper lowerUTF8 upperUTF8 reverse reverseUTF8
    concat concatWithSeparator substring substringUTF8 substr mid left right leftUTF8 rightUTF8 leftPad rightPad
    lpad rpad repeat space trim trimLeft trimRight trimBoth ltrim rtrim startsWith endsWith
    position positionCaseInsensitive positionUTF8 locate countSubstrings countMatches
    replace replaceOne replaceAll replaceRegexpOne replaceRegexpAll regexpExtract splitByChar splitByString
    splitByRegexp splitByWhitespace splitByNonAlpha arrayStringConcat extract extractAll extractGroups
    format formatDateTime formatDateTimeInJodaSyntax formatReadableSize formatReadableDecimalSize
    formatReadableQuantity formatReadableTimeDelta toString toFixedString hex unhex bin unbin base64Encode
    base64Decode tryBase64Decode lowCardinalityKeys lowCardinalityIndices
    now now64 today yesterday timezone toTimeZone toUnixTimestamp toUnixTimestamp64Milli fromUnixTimestamp
    fromUnixTimestamp64Milli fromUnixTimestamp64Micro dateDiff date_diff dateTrunc date_trunc dateAdd date_add
    dateSub date_sub timeSlot timeSlots age
    cityHash64 sipHash64 sipHash128 xxHash32 xxHash64 murmurHash2_64 murmurHash3_64 farmHash64 halfMD5 MD5
    SHA1 SHA256 intHash32 intHash64 javaHash crc32
    rand rand32 rand64 randCanonical generateUUIDv4 toUUID
    materialize ignore identity toTypeName toColumnTypeName byteSize blockSize rowNumberInBlock
    runningDifference runningDifferenceStartingWithFirstValue neighbor bar throwIf
    has hasAll hasAny hasSubstr hasToken indexOf countEqual range emptyArrayUInt8 emptyArrayString
    JSONExtract JSONExtractString JSONExtractInt JSONExtractUInt JSONExtractFloat JSONExtractBool JSONExtractRaw
    JSONExtractKeys JSONHas JSONLength JSONType toJSONString simpleJSONExtractString simpleJSONExtractFloat
    count sum avg min max any anyLast anyHeavy median stddevPop stddevSamp varPop varSamp covarPop covarSamp
    corr entropy skewPop skewSamp kurtPop kurtSamp histogram deltaSum simpleLinearRegression
    boundingRatio retention windowFunnel sequenceMatch sequenceCount sumWithOverflow sumKahan
    exponentialMovingAverage exponentialTimeDecayedAvg
    row_number rank dense_rank percent_rank cume_dist ntile lag lead lagInFrame leadInFrame first_value
    last_value nth_value
""".split())
"""Scalar, aggregate and window functions an analyst query may call (case-folded)."""

_ALLOWED_FAMILIES = re.compile(
    r"(to(?:Int|UInt|Float|Decimal|Date|DateTime|String|Bool|Start|Monday|Year|Quarter|Month|Week|Day|Hour|Minute"
    r"|Second|Unix|Relative|ISO|Time|Interval|LowCardinality|Nullable|TypeName|UUID|IPv)[A-Za-z0-9_]*"
    r"|array[A-Z][A-Za-z0-9]*|quantiles?[A-Z]?[A-Za-z0-9]*|median[A-Z][A-Za-z0-9]*|uniq[A-Z]?[A-Za-z0-9]*"
    r"|group(?:Array|Uniq|Bit|Concat)[A-Za-z0-9]*|topK[A-Za-z0-9]*|(?:sum|min|max)Map[A-Za-z0-9]*"
    r"|(?:add|subtract)(?:Nanoseconds|Microseconds|Milliseconds|Seconds|Minutes|Hours|Days|Weeks|Months|Quarters"
    r"|Years|Interval|TupleOfIntervals)"
    r"|parseDateTime[A-Za-z0-9]*|fromUnixTimestamp[A-Za-z0-9]*|bit(?:And|Or|Xor|Not|Shift|Count|Test)[A-Za-z0-9]*"
    r"|multiSearch[A-Za-z0-9]*|multiMatch[A-Za-z0-9]*|JSONExtract[A-Za-z0-9]*|map(?:Apply|Filter|Sort)[A-Za-z0-9]*"
    r"|tuple[A-Z][A-Za-z0-9]*)")
"""Families of pure functions, matched case-sensitively on the whole name as ClickHouse prints it
(``toDateTime``, ``arrayMap``, ``quantileExact`` …); a family never grows past its stem's meaning."""

_NEVER = tuple(name.lower() for name in """
    file url s3 dict joinGet getSetting getServerSetting getMacro hostName fqdn currentUser
    sleep filesystem tcpPort serverUUID hasColumnInTable address demangle catboost evalMLMethod
    initializeAggregation transactionID getClient displayName getOS zookeeper uptime version
    globalVariable buildId currentProfiles currentRoles enabledRoles defaultRoles currentQueryID queryID
    tokenizeQuery formatQuery normalizeQuery
""".split())
"""Stems never allowed, whatever a family says (a guard against a family growing in a new release)."""


def function_allowed(name: str) -> bool:
    """True when the function ``name`` (as ClickHouse prints it) may appear in an analyst query."""
    if not _PLAIN.fullmatch(name):
        return False
    folded = name.lower()
    candidates = [folded]
    base = folded
    stripped = True
    while stripped:
        stripped = False
        for suffix in _COMBINATORS:
            if base.endswith(suffix) and len(base) > len(suffix):
                base = base[: -len(suffix)]
                candidates.append(base)
                stripped = True
                break
    if any(c.startswith(_NEVER) for c in candidates):
        return False
    if any(c in ALLOWED_FUNCTIONS for c in candidates):
        return True
    # families are matched on the name as written, before and after stripping combinators
    originals = [name[: len(c)] for c in candidates]
    return any(_ALLOWED_FAMILIES.fullmatch(o) for o in originals)


@dataclass
class AstNode:
    """One line of ``EXPLAIN AST``: its type, the name printed after it, and its children."""

    kind: str
    name: str
    children: list[AstNode]
    line: int
    expected: int = 0
    """The number of children ClickHouse printed for this node."""


class AstRefused(ValueError):
    """The tree holds something the gate cannot prove safe; the message says what and where."""


def parse_explain(text: str) -> AstNode:
    """Build the tree from ``EXPLAIN AST`` output (one node a line, one space of indent a level)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise AstRefused("ClickHouse returned an empty parse")
    root: AstNode | None = None
    stack: list[tuple[int, AstNode]] = []  # (depth, node) from the root to the last node read
    for number, raw in enumerate(lines, 1):
        match = _LINE.match(raw)
        if match is None:
            raise AstRefused(f"line {number} of the parse is not a node: {raw[:80]!r}")
        depth = len(match["indent"])
        kind = match["type"]
        rest = match["rest"]
        expected = 0
        if kind != "Literal":  # a literal's text is ClickHouse-escaped and never parsed further
            found = _CHILDREN.search(rest)
            if found:
                expected = int(found["n"])
                rest = rest[: found.start()]
            alias = _ALIAS.search(rest)
            if alias:
                rest = rest[: alias.start()]
            rest = rest.strip()
        else:
            found = _CHILDREN.search(rest)
            if found:
                raise AstRefused(f"a literal with children at line {number}: {raw[:80]!r}")
            rest = ""
        node = AstNode(kind, rest, [], number, expected)
        if root is None:
            if depth != 0:
                raise AstRefused("the parse does not start at the root")
            root = node
        else:
            while stack and stack[-1][0] >= depth:
                stack.pop()
            if not stack or stack[-1][0] != depth - 1:
                raise AstRefused(f"line {number} of the parse has no parent: {raw[:80]!r}")
            stack[-1][1].children.append(node)
        stack.append((depth, node))
    if root is None:  # pragma: no cover - lines is not empty
        raise AstRefused("ClickHouse returned an empty parse")
    for node, _ in _walk(root, None):
        if len(node.children) != node.expected:
            raise AstRefused(f"{_describe(node)}: ClickHouse printed {node.expected} children, the gate read "
                             f"{len(node.children)}; the parse was misread, so the query is refused")
    return root


def _walk(node: AstNode, parent: AstNode | None) -> Iterable[tuple[AstNode, AstNode | None]]:
    """Every node with its parent, depth first; iterative, so a deeply nested statement cannot
    exhaust Python's recursion limit before ClickHouse's own ``max_ast_depth`` refuses it."""
    stack = [(node, parent)]
    while stack:
        current, above = stack.pop()
        yield current, above
        stack.extend((child, current) for child in reversed(current.children))


def check_ast(tree: AstNode, *, tables: frozenset[str], defined: frozenset[str] = frozenset()) -> None:
    """Raise :class:`AstRefused` unless every node of ``tree`` is allowed.

    ``tables`` are the store's own table names (unqualified); ``defined`` are names the
    statement itself defines (``WITH name AS (SELECT …)``), which may be read as tables too.
    """
    readable = tables | defined
    for node, parent in _walk(tree, None):
        if node.kind in _UNSHOWN:
            raise AstRefused(f"{_UNSHOWN[node.kind]} ({_describe(node)})")
        if node.kind not in _NODE_TYPES:
            raise AstRefused(f"{_describe(node)} is not part of a plain SELECT")
        if node.name and node.kind not in _NAMED:
            raise AstRefused(f"{_describe(node)}: this node type carries no name the gate can check")
        if node.kind == "Function" and not node.name:
            raise AstRefused(f"{_describe(node)}: a function whose name the parse does not show")
        if node.kind == "Function":
            if parent is not None and parent.kind == "TableExpression":
                if node.name.lower() not in ALLOWED_TABLE_FUNCTIONS:
                    raise AstRefused(f"table function {node.name}() is not allowed; "
                                     f"allowed: {', '.join(sorted(ALLOWED_TABLE_FUNCTIONS))}")
            elif not function_allowed(node.name):
                raise AstRefused(f"function {node.name or '?'}() is not on the allow-list of analyst functions")
            if node.name.lower() in {"in", "notin", "globalin", "globalnotin", "nullin", "notnullin",
                                     "globalnullin", "globalnotnullin"}:
                _check_in_target(node, readable)
        elif node.kind == "TableIdentifier":
            _check_table(node.name, readable)


def _check_in_target(node: AstNode, readable: frozenset[str]) -> None:
    args = node.children[0].children if node.children else []
    if len(args) == 2 and args[1].kind == "Identifier":
        # ``x IN name`` reads the table ``name`` when one exists, so treat it as a table read.
        _check_table(args[1].name, readable)


def _check_table(name: str, readable: frozenset[str]) -> None:
    if name not in readable:
        shown = ", ".join(sorted(readable))
        raise AstRefused(f"table {name!r} is not readable; analyst SQL reads fleethealth's tables: {shown}")


def _describe(node: AstNode) -> str:
    return f"{node.kind} {node.name}".strip() + f" (parse line {node.line})"


def parse_and_check(statement: str, explain: Callable[[str], str], *, tables: frozenset[str],
                    defined: frozenset[str]) -> None:
    """Parse ``statement`` with ClickHouse (``explain`` runs ``EXPLAIN AST`` and returns its text) and check it."""
    check_ast(parse_explain(explain(statement)), tables=tables, defined=defined)
