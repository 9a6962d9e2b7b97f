"""The cluster variant of the migrations, generated from the same ``deploy/clickhouse/*.sql`` text.

A store DSN with ``?cluster=NAME`` (``http(s)://`` only) runs every migration statement through
:class:`ClusterDDL`, which rewrites it for a ClickHouse cluster named in the servers'
``remote_servers``, with ``{shard}`` and ``{replica}`` macros and Keeper:

* ``CREATE TABLE t (...) ENGINE = XMergeTree(args) ...`` becomes ``t_local ON CLUSTER`` with
  ``ReplicatedXMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', args)`` on
  every host, and ``t ON CLUSTER AS t_local ENGINE = Distributed(NAME, currentDatabase(), t_local,
  cityHash64(key))``: the application reads and writes ``t`` as before. The shard key is a prefix
  of the sorting key (:data:`SHARD_KEYS`, else its first column), so every version of a row lands
  on one shard and ReplacingMergeTree still collapses replays; a node's samples, events and
  findings share a shard, a job's steps another.
* ``CREATE MATERIALIZED VIEW v TO r AS SELECT ... FROM t`` runs on every host between the local
  tables (``FROM t_local``, ``TO r_local``): each shard rolls up the rows it stores.
* ``ALTER TABLE t`` runs on ``t_local`` and, for column changes, on the Distributed ``t`` too
  (without codecs); ``RENAME`` renames the local tables and re-creates the Distributed ones under
  the new names; ``DROP`` drops both; ``INSERT ... SELECT`` runs once, through the Distributed
  tables.
* ``schema_migrations`` is one replicated table that every host holds (no shard in its path).

Nothing here talks to a server: :meth:`ClusterDDL.translate` is pure text, so the generated DDL is
tested by ClickHouse's own parser (``EXPLAIN AST``) where no cluster runs. A statement of a form it
does not know raises :class:`~fleethealth.errors.StoreError` instead of running unreplicated.
"""

from __future__ import annotations

import re

from fleethealth.errors import StoreError

__all__ = ["ClusterDDL", "SHARD_KEYS", "LOCAL_SUFFIX", "migrations_ddl"]

LOCAL_SUFFIX = "_local"
SHARD_KEYS: dict[str, str] = {"deadletter": "topic, partition"}
"""Shard keys that are not the sorting key's first column (a prefix of it, always)."""

_REPLICA_PATH = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_CREATE_TABLE = re.compile(
    rf"^CREATE\s+TABLE\s+(?P<ine>IF\s+NOT\s+EXISTS\s+)?(?P<name>{_IDENT})\s*(?P<body>\(.*\))\s*"
    rf"ENGINE\s*=\s*(?P<engine>\w*MergeTree)(?:\((?P<args>[^)]*)\))?(?P<rest>.*)$", re.S | re.I)
_CREATE_MV = re.compile(
    rf"^CREATE\s+MATERIALIZED\s+VIEW\s+(?P<ine>IF\s+NOT\s+EXISTS\s+)?(?P<name>{_IDENT})\s+TO\s+(?P<to>{_IDENT})"
    rf"\s+AS\s+(?P<select>SELECT\b.*)$", re.S | re.I)
_ALTER = re.compile(rf"^ALTER\s+TABLE\s+(?P<name>{_IDENT})\s+(?P<actions>.*)$", re.S | re.I)
_RENAME = re.compile(r"^RENAME\s+TABLE\s+(?P<pairs>.*)$", re.S | re.I)
_DROP = re.compile(rf"^DROP\s+TABLE\s+(?P<ie>IF\s+EXISTS\s+)?(?P<name>{_IDENT})\s*$", re.S | re.I)
_INSERT = re.compile(r"^INSERT\s+INTO\b", re.I)
_ORDER_BY = re.compile(rf"\bORDER\s+BY\s+(\([^)]*\)|{_IDENT})", re.I)
_FROM = re.compile(rf"\bFROM\s+({_IDENT})\b", re.I)
_CODEC = re.compile(r"\s+CODEC\((?:[^()]|\([^()]*\))*\)", re.I)


def migrations_ddl(cluster: str) -> str:
    """``schema_migrations`` for a cluster: replicated on every host, not sharded."""
    return (f"CREATE TABLE IF NOT EXISTS schema_migrations ON CLUSTER {cluster}\n(\n    version UInt32,\n"
            "    name String,\n    checksum String,\n    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)\n)\n"
            "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{database}/schema_migrations', '{replica}')\n"
            "ORDER BY version")


class ClusterDDL:
    """Rewrites migration statements for the cluster ``name``; feed it every migration in order
    (applied or not), since a table's shard key is learned where the table is created."""

    def __init__(self, cluster: str) -> None:
        if not re.fullmatch(_IDENT, cluster):
            raise StoreError(f"cluster name {cluster!r} is not a plain identifier")
        self.cluster = cluster
        self.shard_keys: dict[str, str] = {}

    def translate(self, statement: str) -> list[str]:
        """The statements that carry out ``statement`` on the cluster, in order."""
        text = statement.strip()
        for pattern, handler in ((_CREATE_TABLE, self._create_table), (_CREATE_MV, self._create_view),
                                 (_ALTER, self._alter), (_RENAME, self._rename), (_DROP, self._drop)):
            match = pattern.match(text)
            if match:
                return handler(match)
        if _INSERT.match(text):
            return [text]
        raise StoreError(f"no cluster form for the migration statement {text.splitlines()[0][:80]!r}")

    # ---------------------------------------------------------------- the statement forms
    def _create_table(self, m: re.Match[str]) -> list[str]:
        name, ine, rest = m["name"], m["ine"] or "", m["rest"]
        order = _ORDER_BY.search(rest)
        if order is None:
            raise StoreError(f"table {name} has no ORDER BY to derive a shard key from")
        sorting = [c.strip() for c in order.group(1).strip("()").split(",") if c.strip()]
        self.shard_keys[name] = SHARD_KEYS.get(name, sorting[0])
        args = f"{_REPLICA_PATH}, {m['args']}" if m["args"] and m["args"].strip() else _REPLICA_PATH
        rest = rest.replace("non_replicated_deduplication_window", "replicated_deduplication_window")
        local = (f"CREATE TABLE {ine}{name}{LOCAL_SUFFIX} ON CLUSTER {self.cluster}\n{m['body']}\n"
                 f"ENGINE = Replicated{m['engine']}({args}){rest}")
        return [local, self._distributed(name, ine)]

    def _distributed(self, name: str, ine: str = "") -> str:
        return (f"CREATE TABLE {ine}{name} ON CLUSTER {self.cluster} AS {name}{LOCAL_SUFFIX}\n"
                f"ENGINE = Distributed({self.cluster}, currentDatabase(), {name}{LOCAL_SUFFIX}, "
                f"cityHash64({self.shard_keys[name]}))")

    def _create_view(self, m: re.Match[str]) -> list[str]:
        select = _FROM.sub(lambda f: f"FROM {self._local(f.group(1))}", m["select"])
        return [f"CREATE MATERIALIZED VIEW {m['ine'] or ''}{m['name']} ON CLUSTER {self.cluster} "
                f"TO {self._local(m['to'])} AS\n{select}"]

    def _alter(self, m: re.Match[str]) -> list[str]:
        name, actions = m["name"], m["actions"]
        out = [f"ALTER TABLE {self._local(name)} ON CLUSTER {self.cluster} {actions}"]
        if re.match(r"(ADD|DROP|MODIFY|RENAME|COMMENT)\s+COLUMN\b", actions, re.I):
            out.append(f"ALTER TABLE {name} ON CLUSTER {self.cluster} {_CODEC.sub('', actions)}")
        return out

    def _rename(self, m: re.Match[str]) -> list[str]:
        pairs = []
        for part in m["pairs"].split(","):
            names = re.fullmatch(rf"\s*({_IDENT})\s+TO\s+({_IDENT})\s*", part, re.I)
            if names is None:
                raise StoreError(f"cannot read the rename {part.strip()!r}")
            pairs.append((names.group(1), names.group(2)))
        keys = {old: self._key(old) for old, _ in pairs}
        local = ", ".join(f"{old}{LOCAL_SUFFIX} TO {new}{LOCAL_SUFFIX}" for old, new in pairs)
        out = [f"RENAME TABLE {local} ON CLUSTER {self.cluster}"]
        out += [f"DROP TABLE IF EXISTS {old} ON CLUSTER {self.cluster}" for old, _ in pairs]
        for old, new in pairs:
            self.shard_keys[new] = keys[old]
        out += [self._distributed(new) for _, new in pairs]
        return out

    def _drop(self, m: re.Match[str]) -> list[str]:
        name, ie = m["name"], m["ie"] or ""
        if not ie:
            self._key(name)
        self.shard_keys.pop(name, None)
        return [f"DROP TABLE {ie}{name} ON CLUSTER {self.cluster}",
                f"DROP TABLE {ie}{name}{LOCAL_SUFFIX} ON CLUSTER {self.cluster}"]

    # ---------------------------------------------------------------- names
    def _key(self, name: str) -> str:
        try:
            return self.shard_keys[name]
        except KeyError:
            raise StoreError(f"table {name} is not created by an earlier migration") from None

    def _local(self, name: str) -> str:
        self._key(name)
        return f"{name}{LOCAL_SUFFIX}"
