"""Explicit detector state: any detector as plain data (a JSON tree and numeric arrays) and back.

``state_dict(obj)`` walks an object's attributes and returns a :class:`State`: ``tree``, a value
JSON can hold, and ``arrays``, the NumPy arrays it refers to by index. ``from_state(state)`` builds
the object again. ``state_dict`` copies no array: until it is sealed (:mod:`~fleethealth.detectors.snapshot`),
a state's arrays are the object's own and change as it is fed. ``from_state`` copies every array it reads,
so a rebuilt object never shares memory with the one its state was taken from (fed side by side in one
process, the two stay apart). It is strict both ways:

* what may be written is plain data — ``None``, ``bool``, ``int``, ``float`` (infinities and NaN
  too), ``str``, ``bytes``, ``list``, ``tuple``, ``set``, ``frozenset``, ``deque``, ``dict`` (any of these as
  keys), NumPy arrays of a numeric, boolean or fixed-width text dtype (:data:`ARRAY_DTYPES`) or of
  Python strings, NumPy scalars of those dtypes — and instances of **registered classes**,
  written as their stable name (``module.QualName``) and their attributes. Anything else (a
  function, a lock, a file, a model object) is a :class:`StateError` naming the path to it.
* what is rebuilt is only that: containers, arrays copied out of the blob, registered classes made
  with ``cls.__new__(cls)`` and their attributes set from plain data. Nothing named by the blob is
  imported, looked up outside the registry or called: no ``__init__``, ``__setstate__`` or
  ``__reduce__`` runs.

**Registered classes** are every class defined in :data:`STATE_MODULES` (the detectors, the wire
schema) — dataclasses, enums and the detectors themselves — so a field someone adds to a detector
is in its state with no change here, and a class added to one of those modules is too. A class
outside them is refused when written, by name.

**Per-class overrides.** A class lists in ``_state_skip`` attributes that are configuration or
objects rather than data (the pipeline's straggler factory, the predictor's model); they are not
written, and ``from_state(state, like=configured)`` takes them from ``like``, the object built
from the configuration, at the same place in the tree (``like.hang`` for the pipeline's ``hang``).
After its attributes are set, a class's ``_state_restored(like)`` runs if it defines one (the
predictor takes its model from ``like`` or from its configured path, never from the state).

**Shared objects** (``shared={"name": obj}``: the node-state table every job-stage pipeline of a
replica reads) are written as a reference by name and replaced by the object given under that name
when read; a name not given is a :class:`StateError`.

Identity is kept: an object, container or array held in two places is written once and comes back
held in both (later occurrences are ``["@", n]``, ``n`` counting the objects, containers and arrays
of the tree in the order written).

Tree encoding: a JSON object is a dict with ``str`` keys; a JSON array is a tagged node
``[tag, ...]``: ``l`` list, ``t`` tuple, ``s`` set, ``z`` frozenset, ``q`` deque (``[q, maxlen,
*items]``), ``d`` dict with other keys (``[d, [k, v], ...]``), ``f`` a non-finite float, ``i`` an
int beyond 64 bits, ``n`` a NumPy scalar, ``a`` an array (index), ``c`` a dict of equal 1-D
arrays packed as the rows of one array (``[c, index, *keys]``: a telemetry sample's columns),
``x`` an array of Python strings, ``y`` bytes (base64), ``e`` an enum member, ``o`` an object
(``[o, name, {attr: value}]``), ``r`` a shared object, ``@`` an object already written.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import functools
import math
import re
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fleethealth.errors import FleetHealthError

__all__ = ["State", "StateError", "Stateful", "state_dict", "from_state", "registered", "ARRAY_DTYPES",
           "STATE_MODULES", "array_dtype", "names"]

STATE_MODULES = (
    "fleethealth.schema", "fleethealth.xid", "fleethealth.detectors.assembly", "fleethealth.detectors.diagnosis",
    "fleethealth.detectors.hang", "fleethealth.detectors.health", "fleethealth.detectors.lifecycle",
    "fleethealth.detectors.nodestate", "fleethealth.detectors.pipeline", "fleethealth.detectors.predict",
    "fleethealth.detectors.sdc", "fleethealth.detectors.straggler", "fleethealth.detectors.thermal",
    "fleethealth.detectors.window",
    "fleethealth.payloads", "fleethealth.detectors.cores",
)
"""Modules whose classes may be written into a state and rebuilt from one (imported on first use); a
package stands for its modules (``fleethealth.payloads``: every shared payload)."""

ARRAY_DTYPES = frozenset({"|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"})
"""Array dtypes a state may hold (little-endian), plus fixed-width text ``<U1`` … ``<U4096``; never object."""
_TEXT = re.compile(r"<U([1-9][0-9]{0,3})")
_INT64 = (-(2**63), 2**64 - 1)


class StateError(FleetHealthError):
    """A state cannot be written (a value that is not plain data, a class not registered) or read
    (an unknown tag or class, an attribute that is not a name, an array index out of range)."""


@dataclasses.dataclass
class State:
    """An object as plain data: ``tree`` (JSON-ready) and the ``arrays`` it refers to by index."""

    tree: Any
    arrays: list[np.ndarray]


def array_dtype(name: object) -> np.dtype:
    """The dtype a state's array may have, by its ``str`` (``"<f8"``); anything else is a :class:`StateError`."""
    if isinstance(name, str) and (name in ARRAY_DTYPES or _TEXT.fullmatch(name)):
        return np.dtype(name)
    raise StateError(f"array dtype {name!r} is not one a state may hold (numeric, bool or fixed-width text)")


_REGISTRY: dict[str, type] = {}
_NAMES: dict[type, str] = {}


def _load_registry() -> None:
    if _REGISTRY:
        return
    import importlib
    import pkgutil

    names: list[str] = []
    for module_name in STATE_MODULES:
        names.append(module_name)
        path = getattr(importlib.import_module(module_name), "__path__", None)
        if path is not None:
            names += [f"{module_name}.{m.name}" for m in pkgutil.iter_modules(path)]
    for module_name in names:
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if (isinstance(value, type) and value.__module__ == module_name
                    and not issubclass(value, BaseException) and value.__qualname__.count(".") == 0):
                name = f"{module_name}.{value.__qualname__}"
                _REGISTRY[name] = value
                _NAMES[value] = name


def registered() -> dict[str, type]:
    """Every class a state may hold, by its stable name."""
    _load_registry()
    return dict(_REGISTRY)


def _skip(cls: type) -> frozenset[str]:
    return frozenset(getattr(cls, "_state_skip", ()))


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        for s in klass.__dict__.get("__slots__", ()):
            if s not in ("__dict__", "__weakref__") and s not in names:
                names.append(s)
    return names


class _Writer:
    def __init__(self, shared: Mapping[str, object] | None) -> None:
        _load_registry()
        self.arrays: list[np.ndarray] = []
        self.memo: dict[int, int] = {}
        self.keep: list[object] = []  # ids stay valid while writing
        self.count = 0
        self.shared = {id(obj): name for name, obj in (shared or {}).items()}

    def _mark(self, obj: object) -> None:
        self.memo[id(obj)] = self.count
        self.keep.append(obj)
        self.count += 1

    def write(self, v: Any, path: str) -> Any:
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if _INT64[0] <= v <= _INT64[1] else ["i", str(v)]
        if t is float:
            return v if math.isfinite(v) else ["f", repr(v)]
        if t is bytes:
            return ["y", base64.b64encode(v).decode()]
        if self.shared and id(v) in self.shared:
            return ["r", self.shared[id(v)]]
        seen = self.memo.get(id(v))
        if seen is not None:
            return ["@", seen]
        if t is dict:
            packed = self._packed(v)
            if packed is not None:
                return packed
            self._mark(v)
            if all(type(k) is str for k in v):
                return {k: self.write(x, f"{path}.{k}") for k, x in v.items()}
            return ["d", *([self.write(k, f"{path}<key>"), self.write(x, f"{path}[{k!r}]")] for k, x in v.items())]
        if t is list:
            self._mark(v)
            return ["l", *(self.write(x, f"{path}[{i}]") for i, x in enumerate(v))]
        if t is tuple:
            return ["t", *(self.write(x, f"{path}[{i}]") for i, x in enumerate(v))]
        if t is set or t is frozenset:
            self._mark(v)
            items = [self.write(x, f"{path}{{}}") for x in v]
            return ["s" if t is set else "z", *items]
        if t is deque:
            self._mark(v)
            return ["q", v.maxlen, *(self.write(x, f"{path}[{i}]") for i, x in enumerate(v))]
        if t is np.ndarray:
            return self._array(v, path)
        if isinstance(v, np.generic):
            return self._scalar(v, path)
        if isinstance(v, enum.Enum):
            name = _NAMES.get(t)
            if name is None:
                raise StateError(f"{path}: enum {t.__module__}.{t.__qualname__} is not a registered state class")
            return ["e", name, self.write(v.value, path)]
        name = _NAMES.get(t)
        if name is None:
            what = f"{t.__module__}.{t.__qualname__}"
            raise StateError(f"{path}: a {what} is not plain data nor a registered state class (one of "
                             "STATE_MODULES): name the attribute in its owner's _state_skip")
        self._mark(v)
        skip = _skip(t)
        attrs = dict(vars(v)) if hasattr(v, "__dict__") else {}
        for s in _slots(t):
            if hasattr(v, s):
                attrs[s] = getattr(v, s)
        return ["o", name, {k: self.write(x, f"{path}.{k}") for k, x in attrs.items() if k not in skip}]

    def _packed(self, v: dict) -> list | None:
        """A dict of two or more distinct 1-D arrays of one dtype and length under ``str`` keys (a sample's
        columns) as one matrix, a row per key: one array to write instead of one per column."""
        if len(v) < 2:
            return None
        first = next(iter(v.values()))
        if type(first) is not np.ndarray or first.ndim != 1 or first.dtype == object:
            return None
        ids = set()
        for k, a in v.items():
            if (type(k) is not str or type(a) is not np.ndarray or a.dtype != first.dtype or a.shape != first.shape
                    or id(a) in self.memo or id(a) in ids or (self.shared and id(a) in self.shared)):
                return None
            ids.add(id(a))
        dtype = first.dtype.newbyteorder("<") if first.dtype.byteorder == ">" else first.dtype
        if not (dtype.str in ARRAY_DTYPES or _TEXT.fullmatch(dtype.str)):
            return None
        self._mark(v)
        for a in v.values():
            self._mark(a)
        self.arrays.append(np.stack(list(v.values())).astype(dtype, copy=False))
        return ["c", len(self.arrays) - 1, *v]

    def _array(self, a: np.ndarray, path: str) -> Any:
        self._mark(a)
        if a.dtype == object:
            flat = a.ravel().tolist()
            if not all(type(x) is str for x in flat):
                raise StateError(f"{path}: an object array holding other than str cannot be in a state")
            return ["x", list(a.shape), *flat]
        if a.dtype.str not in ARRAY_DTYPES:  # (the common case needs no more checks)
            dtype = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
            try:
                array_dtype(dtype.str)
            except StateError as exc:
                raise StateError(f"{path}: {exc}") from None
            a = a.astype(dtype)
        self.arrays.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))
        return ["a", len(self.arrays) - 1]

    def _scalar(self, v: np.generic, path: str) -> Any:
        dtype = v.dtype.newbyteorder("<") if v.dtype.byteorder == ">" else v.dtype
        try:
            array_dtype(dtype.str)
        except StateError as exc:
            raise StateError(f"{path}: {exc}") from None
        value = v.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = ["f", repr(value)]
        return ["n", dtype.str, value]


def state_dict(obj: object, *, shared: Mapping[str, object] | None = None) -> State:
    """``obj`` as plain data (see the module docstring); a value that is not is a :class:`StateError`."""
    writer = _Writer(shared)
    tree = writer.write(obj, type(obj).__name__)
    return State(tree, writer.arrays)


_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_MAX_DEPTH = 200


class _Reader:
    def __init__(self, arrays: list[np.ndarray], shared: Mapping[str, object] | None) -> None:
        _load_registry()
        self.arrays = arrays
        self.shared = shared or {}
        self.made: list[object] = []

    def read(self, v: Any, like: Any, depth: int) -> Any:
        t = type(v)
        if v is None or t is bool or t is str or t is int or t is float:
            return v
        if depth > _MAX_DEPTH:
            raise StateError(f"state nested deeper than {_MAX_DEPTH}")
        if t is dict:
            out: dict = {}
            self.made.append(out)
            for k, x in v.items():
                out[k] = self.read(x, None, depth + 1)
            return out
        if t is not list or not v or type(v[0]) is not str:
            raise StateError(f"state holds a {t.__name__} where a value or a tagged node belongs")
        tag, rest = v[0], v[1:]
        if tag == "l":
            items: list = []
            self.made.append(items)
            items.extend(self.read(x, None, depth + 1) for x in rest)
            return items
        if tag == "t":
            return tuple(self.read(x, None, depth + 1) for x in rest)
        if tag in ("s", "z"):
            made = set() if tag == "s" else None
            index = len(self.made)
            self.made.append(made)
            values = [self.read(x, None, depth + 1) for x in rest]
            if made is None:
                made = self.made[index] = frozenset(values)
            else:
                made.update(values)
            return made
        if tag == "q":
            if not rest or not (rest[0] is None or (type(rest[0]) is int and rest[0] >= 0)):
                raise StateError("state: a deque without a maxlen")
            q: deque = deque(maxlen=rest[0])
            self.made.append(q)
            q.extend(self.read(x, None, depth + 1) for x in rest[1:])
            return q
        if tag == "d":
            d: dict = {}
            self.made.append(d)
            for pair in rest:
                if type(pair) is not list or len(pair) != 2:
                    raise StateError("state: a dict entry that is not [key, value]")
                d[self.read(pair[0], None, depth + 1)] = self.read(pair[1], None, depth + 1)
            return d
        if tag == "f":
            if len(rest) != 1 or rest[0] not in _FLOATS:
                raise StateError(f"state: {rest!r} is not a non-finite float")
            return _FLOATS[rest[0]]
        if tag == "y":
            if len(rest) != 1 or type(rest[0]) is not str:
                raise StateError("state: bytes that are not one base64 string")
            try:
                return base64.b64decode(rest[0], validate=True)
            except binascii.Error as exc:
                raise StateError(f"state: bytes that are not base64 ({exc})") from None
        if tag == "i":
            if len(rest) != 1 or type(rest[0]) is not str or not re.fullmatch(r"-?[0-9]{1,80}", rest[0]):
                raise StateError("state: a large int that is not digits")
            return int(rest[0])
        if tag == "n":
            if len(rest) != 2:
                raise StateError("state: a NumPy scalar that is not [dtype, value]")
            value = self.read(rest[1], None, depth + 1)
            if type(value) not in (bool, int, float, str):
                raise StateError("state: a NumPy scalar whose value is not a number")
            return array_dtype(rest[0]).type(value)
        if tag == "a":
            if len(rest) != 1 or type(rest[0]) is not int or not 0 <= rest[0] < len(self.arrays):
                raise StateError(f"state refers to array {rest!r}, not one of the {len(self.arrays)} it holds")
            a = self.arrays[rest[0]].copy()  # never the arrays of the object the state was taken from
            self.made.append(a)
            return a
        if tag == "c":
            if (not rest or type(rest[0]) is not int or not 0 <= rest[0] < len(self.arrays)
                    or not all(type(k) is str for k in rest[1:])):
                raise StateError("state: packed columns that are not [array index, names...]")
            matrix = self.arrays[rest[0]].copy()
            if matrix.ndim != 2 or matrix.shape[0] != len(rest) - 1:
                raise StateError(f"state: packed columns of {len(rest) - 1} names in an array of shape {matrix.shape}")
            columns: dict = {}
            self.made.append(columns)
            for k, row in zip(rest[1:], matrix, strict=True):
                columns[k] = row
                self.made.append(row)
            return columns
        if tag == "x":
            if not rest or type(rest[0]) is not list or not all(type(n) is int and n >= 0 for n in rest[0]):
                raise StateError("state: a text array without a shape")
            flat = rest[1:]
            if math.prod(rest[0]) != len(flat) or not all(type(x) is str for x in flat):
                raise StateError("state: a text array whose items do not fit its shape or are not text")
            out_a = np.empty(len(flat), dtype=object)
            out_a[:] = flat
            out_a = out_a.reshape(rest[0])
            self.made.append(out_a)
            return out_a
        if tag == "e":
            cls = self._class(rest[0] if rest else None)
            if not issubclass(cls, enum.Enum) or len(rest) != 2:
                raise StateError(f"state: {rest[0]!r} is not an enum")
            try:
                return cls._value2member_map_[rest[1]]
            except (KeyError, TypeError):
                raise StateError(f"state: {rest[1]!r} is not a member of {rest[0]}") from None
        if tag == "o":
            return self._object(rest, like, depth)
        if tag == "r":
            if len(rest) != 1 or type(rest[0]) is not str or rest[0] not in self.shared:
                given = ", ".join(sorted(self.shared)) or "none"
                raise StateError(f"state refers to the shared object {rest[:1]!r}, which was not given "
                                 f"(given: {given})")
            return self.shared[rest[0]]
        if tag == "@":
            if len(rest) != 1 or type(rest[0]) is not int or not 0 <= rest[0] < len(self.made):
                raise StateError(f"state refers back to {rest!r}, which was not read before")
            return self.made[rest[0]]
        raise StateError(f"state holds an unknown tag {tag!r}")

    def _class(self, name: object) -> type:
        cls = _REGISTRY.get(name) if isinstance(name, str) else None
        if cls is None:
            raise StateError(f"state names the class {name!r}, which is not a registered state class")
        return cls

    def _object(self, rest: list, like: Any, depth: int) -> Any:
        if len(rest) != 2 or type(rest[1]) is not dict:
            raise StateError("state: an object that is not [class, {attributes}]")
        cls = self._class(rest[0])
        if issubclass(cls, enum.Enum):
            raise StateError(f"state: the enum {rest[0]} written as an object")
        obj = cls.__new__(cls)
        self.made.append(obj)
        like = like if type(like) is cls else None
        slots = set(_slots(cls))
        for attr, value in rest[1].items():
            if not _NAME.fullmatch(attr) or attr.startswith("__"):
                raise StateError(f"state: {attr!r} is not an attribute name of {rest[0]}")
            if _behaviour(cls, attr):
                raise StateError(f"state: {attr!r} would replace a method or property of {rest[0]}")
            decoded = self.read(value, getattr(like, attr, None) if like is not None else None, depth + 1)
            if attr in slots or not hasattr(obj, "__dict__"):
                object.__setattr__(obj, attr, decoded)
            else:
                obj.__dict__[attr] = decoded
        if like is not None:
            for attr in _skip(cls):
                if hasattr(like, attr):
                    object.__setattr__(obj, attr, getattr(like, attr))
        hook = getattr(cls, "_state_restored", None)
        if hook is not None:
            hook(obj, like)
        return obj


def _behaviour(cls: type, attr: str) -> bool:
    """Whether ``attr`` names a method, property or other descriptor of ``cls`` (which state may not shadow)."""
    found = _BEHAVIOUR.get(cls)
    if found is None:
        found = _BEHAVIOUR[cls] = frozenset(
            name for klass in cls.__mro__ if klass is not object for name, value in vars(klass).items()
            if name not in _slots(cls) and not isinstance(value, functools.cached_property)  # (its cache)
            and (callable(value) or hasattr(value, "__get__")))
    return attr in found


_BEHAVIOUR: dict[type, frozenset[str]] = {}


def from_state(state: State, *, like: object = None, shared: Mapping[str, object] | None = None,
               expect: type | None = None) -> Any:
    """The object :func:`state_dict` wrote. ``like`` is the object built from the configuration that
    it replaces: attributes a class does not write (``_state_skip``) are taken from it. With ``expect``,
    a state of another type is a :class:`StateError`."""
    try:
        out = _Reader(state.arrays, shared).read(state.tree, like, 0)
    except RecursionError:
        raise StateError("state nested too deeply") from None
    except (TypeError, ValueError, OverflowError) as exc:  # an unhashable key, a value out of its dtype's range
        raise StateError(f"state does not fit: {type(exc).__name__}: {exc}") from None
    if expect is not None and type(out) is not expect:
        raise StateError(f"state holds a {type(out).__name__}, not the expected {expect.__name__}")
    return out


def names(what: str, values: Iterable[str]) -> frozenset[str]:
    """``values`` (job or node names) as a set; one name passed alone, not in a collection, is a
    ``TypeError`` (a string is iterable, and would forget its letters)."""
    if isinstance(values, str | bytes):
        raise TypeError(f"forget({what}=...) takes a collection of names, not the single name {values!r}")
    return frozenset(values)


class Stateful:
    """``state_dict()`` and ``from_state(...)`` for a detector (the codec of this module).

    Subclasses list configuration and objects that are not data in ``_state_skip``; they come from
    the configured object passed as ``like``. Bounded state is each detector's own ``forget(jobs,
    nodes)``: after ``forget(jobs=J, nodes=N)`` its state names no job of ``J`` and no node of ``N``
    (``tests/detectors/test_common.py`` calls it on every detector and checks it)."""

    _state_skip: tuple[str, ...] = ()

    def state_dict(self, *, shared: Mapping[str, object] | None = None) -> State:
        """This detector's state as plain data: a JSON tree and the arrays it refers to."""
        return state_dict(self, shared=shared)

    @classmethod
    def from_state(cls, state: State, *, like: object = None, shared: Mapping[str, object] | None = None) -> Any:
        """A detector of this class with ``state``; what the state does not carry comes from ``like``."""
        return from_state(state, like=like, shared=shared, expect=cls)

