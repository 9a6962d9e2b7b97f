"""The gate in front of analyst SQL (``POST /v1/query``): one read-only statement or nothing.

The gate is a lexer, not a parser. It splits the text into words, quoted names, strings,
punctuation and semicolons, skipping comments, and refuses before anything reaches the store:

* an empty request, an unterminated string, quoted name or comment;
* anything but ``SELECT`` or ``WITH`` as the first word (after opening parentheses);
* a second statement after a semicolon (one trailing semicolon is dropped);
* a write or DDL keyword anywhere (``INSERT``, ``ALTER``, ``CREATE``, ``DROP``, ...);
* ``APPLY`` (the column transformer: the parse does not show the function it applies, see
  :mod:`fleethealth.api.sqlast`, which refuses it too);
* ``INTO OUTFILE`` (chDB writes the file even in read-only mode), ``FORMAT`` and ``SETTINGS``
  clauses (the server chooses the output format and the limits);
* table functions that reach outside the store (``file``, ``url``, ``s3``, ``remote``, ...).

The gate is the first line; the second is the store itself: the statement runs with the
ClickHouse settings ``readonly=1``, ``max_result_rows``, ``max_result_bytes``,
``max_execution_time``, ``max_memory_usage`` and ``max_bytes_to_read``.

Where the lexer and ClickHouse could read the same text differently, the gate refuses instead
of guessing: ClickHouse nests block comments, reads ``$$ ... $$`` (and ``$tag$ ... $tag$``) as
heredoc strings and ``#`` followed by a space or ``!`` as a line comment, so a ``/*`` inside a
block comment, any ``$`` or ``#`` outside strings, quoted names and comments, and control
characters other than whitespace are refused (reason ``ambiguous``). What remains is lexed the
same way by both: a token the gate checks is a token ClickHouse runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from fleethealth.errors import SchemaError

__all__ = ["QueryRefused", "RefusalReason", "Token", "TokenKind", "check_select", "tokenize", "MAX_SQL_CHARS",
           "SqlGate", "defined_names", "fleethealth_tables"]

MAX_SQL_CHARS = 100_000
"""Longer requests are refused unread."""

_FORBIDDEN_WORDS = frozenset({
    "INSERT", "ALTER", "CREATE", "DROP", "TRUNCATE", "RENAME", "ATTACH", "DETACH", "OPTIMIZE",
    "GRANT", "REVOKE", "KILL", "DELETE", "UPDATE", "EXCHANGE", "UNDROP", "BACKUP", "RESTORE",
    "OUTFILE", "SETTINGS", "SET", "USE", "APPLY",
})
"""Words refused anywhere outside strings and quoted names."""

_OUTSIDE_TABLE_FUNCTIONS = frozenset({
    "FILE", "URL", "S3", "S3CLUSTER", "GCS", "HDFS", "HDFSCLUSTER", "REMOTE", "REMOTESECURE",
    "CLUSTER", "CLUSTERALLREPLICAS", "MYSQL", "POSTGRESQL", "JDBC", "ODBC", "EXECUTABLE", "INPUT",
    "AZUREBLOBSTORAGE", "AZUREBLOBSTORAGECLUSTER", "SQLITE", "MONGODB", "REDIS", "ICEBERG",
    "ICEBERGS3", "DELTALAKE", "HUDI", "URLCLUSTER", "FILECLUSTER", "ARROWFLIGHT", "PYTHON",
})
"""Table functions refused when called (the word followed by ``(``)."""


class RefusalReason(StrEnum):
    """Why the gate refused a request (also the ``reason`` label of the refusal counter)."""

    EMPTY = "empty"
    TOO_LONG = "too_long"
    UNTERMINATED = "unterminated"
    NOT_SELECT = "not_select"
    MULTI_STATEMENT = "multi_statement"
    FORBIDDEN_KEYWORD = "forbidden_keyword"
    FORMAT_CLAUSE = "format_clause"
    TABLE_FUNCTION = "table_function"
    AMBIGUOUS = "ambiguous"
    NON_ASCII = "non_ascii"
    NOT_ALLOWED = "not_allowed"
    SYNTAX = "syntax"


class QueryRefused(SchemaError):
    """Analyst SQL refused before execution; ``reason`` is a :class:`RefusalReason`."""

    def __init__(self, reason: RefusalReason, problem: str) -> None:
        self.reason = reason
        super().__init__("sql", problem)


class TokenKind(StrEnum):
    WORD = "word"
    QUOTED = "quoted"
    STRING = "string"
    SEMI = "semi"
    PUNCT = "punct"


@dataclass(frozen=True)
class Token:
    """One lexeme: ``text`` is upper-cased for words; ``pos`` is its offset in the request."""

    kind: TokenKind
    text: str
    pos: int
    original: str = ""
    """The text as written (``text`` upper-cases words)."""


def _skip_quoted(sql: str, start: int, quote: str) -> int:
    """Return the offset after the closing quote of a literal opened at ``start``."""
    i = start + 1
    n = len(sql)
    while i < n:
        ch = sql[i]
        if ch == "\\":
            i += 2
            continue
        if ch == quote:
            if i + 1 < n and sql[i + 1] == quote:
                i += 2
                continue
            return i + 1
        i += 1
    what = "string" if quote == "'" else "quoted name"
    raise QueryRefused(RefusalReason.UNTERMINATED, f"unterminated {what} starting at offset {start}")


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What a quoted name may hold: the quotes then change nothing ClickHouse reads."""

_ASCII_SPACE = frozenset(" \t\n\r\f\v")
"""Whitespace as ClickHouse reads it."""

_AMBIGUOUS_CHARS = frozenset("$#")
"""Refused outside strings: ``$`` opens a ClickHouse heredoc, ``# `` and ``#!`` a line comment."""


def _skip_block_comment(sql: str, start: int) -> int:
    """Return the offset after the ``*/`` closing the comment at ``start``; refuse a nested ``/*``."""
    end = sql.find("*/", start + 2)
    if end < 0:
        raise QueryRefused(RefusalReason.UNTERMINATED, f"unterminated comment starting at offset {start}")
    nested = sql.find("/*", start + 2, end + 1)
    if nested >= 0:
        raise QueryRefused(RefusalReason.AMBIGUOUS,
                           f"nested comment at offset {nested} is not allowed (ClickHouse nests block comments)")
    return end + 2


def tokenize(sql: str) -> list[Token]:
    """Split ``sql`` into tokens, dropping whitespace and comments; raise on unterminated ones."""
    tokens: list[Token] = []
    i = 0
    n = len(sql)
    while i < n:
        ch = sql[i]
        if ch in _ASCII_SPACE:
            i += 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            i = _skip_block_comment(sql, i)
        elif ord(ch) > 127:
            raise QueryRefused(RefusalReason.NON_ASCII,
                               f"character {ch!r} (U+{ord(ch):04X}) outside a string literal is not allowed "
                               f"(offset {i}); ClickHouse may read it as whitespace")
        elif ch in _AMBIGUOUS_CHARS or (ord(ch) < 32 and ch not in _ASCII_SPACE):
            raise QueryRefused(RefusalReason.AMBIGUOUS,
                               f"character {ch!r} outside a string is not allowed (offset {i}); "
                               "ClickHouse may read it as a heredoc or comment")
        elif ch in "'\"`":
            end = _skip_quoted(sql, i, ch)
            kind = TokenKind.STRING if ch == "'" else TokenKind.QUOTED
            if kind is TokenKind.QUOTED and not _PLAIN_NAME.fullmatch(sql[i + 1:end - 1]):
                raise QueryRefused(RefusalReason.AMBIGUOUS,
                                   f"quoted name {sql[i:end][:40]!r} at offset {i} is not a plain identifier "
                                   "(letters, digits, underscore)")
            tokens.append(Token(kind, sql[i:end], i))
            i = end
        elif ch == ";":
            tokens.append(Token(TokenKind.SEMI, ";", i))
            i += 1
        elif ch.isalpha() or ch == "_":
            j = i + 1
            while j < n and (sql[j].isalnum() or sql[j] == "_"):
                j += 1
            tokens.append(Token(TokenKind.WORD, sql[i:j].upper(), i, sql[i:j]))
            i = j
        else:
            tokens.append(Token(TokenKind.PUNCT, ch, i))
            i += 1
    return tokens


def _first_word(tokens: list[Token]) -> Token | None:
    for tok in tokens:
        if tok.kind is TokenKind.PUNCT and tok.text == "(":
            continue
        return tok
    return None


def check_select(sql: str, *, max_chars: int = MAX_SQL_CHARS) -> str:
    """Return the one read-only statement in ``sql`` (trailing semicolon dropped) or raise.

    Raises :class:`QueryRefused` naming the reason; nothing is executed here.
    """
    if not isinstance(sql, str):
        raise QueryRefused(RefusalReason.EMPTY, f"expected SQL text, got {type(sql).__name__}")
    if len(sql) > max_chars:
        raise QueryRefused(RefusalReason.TOO_LONG, f"statement of {len(sql)} characters exceeds {max_chars}")
    tokens = tokenize(sql)
    if not tokens:
        raise QueryRefused(RefusalReason.EMPTY, "no statement")
    semis = [k for k, tok in enumerate(tokens) if tok.kind is TokenKind.SEMI]
    if semis and semis[0] != len(tokens) - 1:
        after = tokens[semis[0] + 1]
        raise QueryRefused(RefusalReason.MULTI_STATEMENT,
                           f"only one statement is allowed; found more after the semicolon at offset "
                           f"{tokens[semis[0]].pos} ({after.text[:20]!r})")
    body = tokens[:-1] if semis else tokens
    if not body:
        raise QueryRefused(RefusalReason.EMPTY, "no statement")
    first = _first_word(body)
    if first is None or first.kind is not TokenKind.WORD or first.text not in {"SELECT", "WITH"}:
        shown = "nothing" if first is None else repr(first.text[:20])
        raise QueryRefused(RefusalReason.NOT_SELECT, f"only SELECT or WITH statements are allowed, got {shown}")
    for k, tok in enumerate(body):
        if tok.kind is not TokenKind.WORD:
            continue
        nxt = body[k + 1] if k + 1 < len(body) else None
        calls = nxt is not None and nxt.kind is TokenKind.PUNCT and nxt.text == "("
        if tok.text in _FORBIDDEN_WORDS:
            raise QueryRefused(RefusalReason.FORBIDDEN_KEYWORD,
                               f"{tok.text} is not allowed in a read-only query (offset {tok.pos})")
        if tok.text == "FORMAT" and not calls:
            raise QueryRefused(RefusalReason.FORMAT_CLAUSE,
                               f"a FORMAT clause is not allowed; the API chooses the format (offset {tok.pos})")
        if tok.text in _OUTSIDE_TABLE_FUNCTIONS and calls:
            raise QueryRefused(RefusalReason.TABLE_FUNCTION,
                               f"table function {tok.text.lower()}() reaches outside the store (offset {tok.pos})")
    end = tokens[semis[0]].pos if semis else len(sql)
    return sql[:end].rstrip() + "\n"


def defined_names(tokens: list[Token]) -> frozenset[str]:
    """Names a statement defines as tables with ``WITH name AS (SELECT …)`` (common table expressions)."""
    names = set()
    for k in range(len(tokens) - 3):
        name, as_, paren, first = tokens[k:k + 4]
        if (name.kind in {TokenKind.WORD, TokenKind.QUOTED} and as_.kind is TokenKind.WORD and as_.text == "AS"
                and paren.kind is TokenKind.PUNCT and paren.text == "("
                and first.kind is TokenKind.WORD and first.text in {"SELECT", "WITH"}):
            names.add(name.text[1:-1] if name.kind is TokenKind.QUOTED else name.original)
    return frozenset(names)


_CREATES = re.compile(r"CREATE\s+(?:TABLE|VIEW|MATERIALIZED\s+VIEW)\s+IF\s+NOT\s+EXISTS\s+([A-Za-z_][A-Za-z0-9_]*)",
                      re.IGNORECASE)


NOT_ANALYST_TABLES = frozenset({"detector_snapshots"})
"""Tables analyst SQL never reads: the detector snapshots are the detector replicas' own state."""


def fleethealth_tables() -> frozenset[str]:
    """The tables and views fleethealth's migrations create, less :data:`NOT_ANALYST_TABLES`: what
    analyst SQL may read."""
    from importlib import resources

    names: set[str] = set()
    for entry in resources.files("fleethealth.migrations").iterdir():
        if entry.name.endswith(".sql"):
            names.update(_CREATES.findall(entry.read_text()))
    return frozenset(names) - NOT_ANALYST_TABLES


class SqlGate:
    """Both gates in order: the lexer (:func:`check_select`), then ClickHouse's own parse walked
    against allow-lists (:mod:`fleethealth.api.sqlast`).

    ``explain`` takes a statement and returns the text of ``EXPLAIN AST`` for it (the API passes
    its store: parsing runs no function and opens no table). ``tables`` are the readable tables,
    by default those of :func:`fleethealth_tables`.
    """

    def __init__(self, explain: Callable[[str], str], *, tables: frozenset[str] | None = None) -> None:
        self._explain = explain
        self.tables = fleethealth_tables() if tables is None else frozenset(tables)

    def check(self, sql: str) -> str:
        """Return the statement to run (see :func:`check_select`) or raise :class:`QueryRefused`."""
        from fleethealth.api.sqlast import AstRefused, parse_and_check
        from fleethealth.errors import StoreError

        statement = check_select(sql)
        defined = defined_names(tokenize(statement))
        try:
            parse_and_check(statement, self._explain, tables=self.tables, defined=defined)
        except AstRefused as exc:
            raise QueryRefused(RefusalReason.NOT_ALLOWED, str(exc)) from None
        except StoreError as exc:
            raise QueryRefused(RefusalReason.SYNTAX, f"ClickHouse could not parse the statement: {exc}") from None
        return statement
