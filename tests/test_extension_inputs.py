"""Every function the compiled extension exports refuses malformed input with an error.

treemode builds the extension's inputs itself, but a malformed one (a bug, or a
caller reaching into ``treemode._accel._compiled``) must raise ``TypeError`` or
``ValueError``, never crash the interpreter. Runs where the extension is on.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
from flax import nnx

from treemode import _compat
from treemode._accel import _border
from treemode._tree import _flatten
from treemode._tree._leaves import is_array

ERRORS = (TypeError, ValueError)


class Plain:
    pass


def _malformed_states() -> list[Any]:
    d, lst = {"a": 1}, [1]
    # the 8 container tuples, the 5 type/__dict__ tuples, the top's type and __dict__
    tail = ((), (), (), (), (), None, None)
    good = ((d,), (1,), (d,), (1,), (lst,), (1,), (), (), *tail)
    states: list[Any] = [
        None,
        "abc",
        (),
        ("a",) * 15,
        (None,) * 15,
        ((),) * 14,
        good[:14],
        (*good, None, None),  # 17 items
    ]
    for i in range(13):  # each tuple replaced by a non-tuple
        states.append(good[:i] + ("x",) + good[i + 1 :])
    states += [
        (("x",), (1,), (), (), (), (), (), (), *tail),  # a sized container that is a str
        ((d,), ("1",), (), (), (), (), (), (), *tail),  # a length that is not an int
        ((d,), (), (), (), (), (), (), (), *tail),  # lengths do not align
        ((), (), (lst,), (1,), (), (), (), (), *tail),  # a value-checked list
        ((), (), (), (), ("ab",), ("a",), (), (), *tail),  # an ordered str
        ((), (), (), (), (), (), ({},), ("entries",), (), (), (), (), (Plain,), None, None),
        ((), (), (), (), (), (), ({},), (), (), (), (), (), (Plain,), None, None),  # no entries
        ((), (), (), (), (), (), (), (), (d,), (), (), (), (), None, None),  # a node without type
        ((), (), (), (), (), (), (), (), (), (), (d,), (), (), None, None),  # an owner without dict
        ((), (), (), (), (), (), ({},), ((),), (), (), (), (), (), None, None),  # no Variable type
    ]
    return states


@pytest.mark.parametrize("state", _malformed_states())
def test_holds(extension, state):
    with pytest.raises(ERRORS):
        extension.holds(state, [Plain()] * len(state[6]) if _sized(state) else [], Plain())


def _sized(state: Any) -> bool:
    return isinstance(state, tuple) and len(state) > 6 and isinstance(state[6], tuple)


@pytest.mark.parametrize(
    "args", [(), ((),), (None, None), ((), 3), ((), [], []), ((), [], [], None)]
)
def test_holds_arguments(extension, args):
    with pytest.raises(ERRORS):
        extension.holds(*args)


def test_version_tags(extension):
    with pytest.raises(ERRORS):
        extension.version_tags(3)
    with pytest.raises(ERRORS):
        extension.version_tags(None)


@pytest.mark.parametrize(
    "fields",
    [
        ("x", (), (), None),  # no weak reference to the argument
        (None, (), "variables", None),
        (None, "state", (), None),
    ],
)
def test_guarded_arguments(extension, fields):
    ref = weakref.ref(Plain)
    fields = tuple(ref if f is None else f for f in fields)
    with pytest.raises(ERRORS):
        extension.Guarded(*fields)


def _executing(extension: Any, **changes: Any) -> Any:
    """A `FastCall` executing one record (the well-formed one with ``changes``,
    writable in the current trace); a miss returns ``"missed"``."""

    class Fn(extension.FastCall):
        pass

    f = Fn()
    f._miss = lambda self, error, args, kwargs: ("missed", None)
    fields = _record_fields(trace=_compat.current_trace_ref(), **changes)
    f._records = [extension.FastRecord(**fields)]
    return f


def test_an_executed_record_with_a_malformed_guard_state_raises(extension):
    holder = _Holder()
    guarded = extension.Guarded(weakref.ref(Plain), ("a",) * 15, (), weakref.ref(holder))

    f = _executing(extension, slots=(weakref.ref(guarded),))
    with pytest.raises(ERRORS):
        f(Plain)


class _Holder:
    pass


@pytest.mark.parametrize(
    "reads",
    [
        ((), (), (), (), (), ("pair",), ()),  # a cell read is (holder, contents)
        ((), (), (), (), (), ((len, None),), ()),
        ((), (), (), (), (), (), ("triple",)),  # an attribute read is (owner, name, value)
    ],
)
def test_an_executed_record_with_malformed_closure_reads_raises(extension, reads):
    with pytest.raises(TypeError):
        _executing(extension, closure_reads=reads)(1.0)
    # The same record with well-formed reads runs its entry: ``(out, updates)``.
    assert _executing(extension, jitted=lambda x: (x * 2, None))(1.0) == 2.0


@pytest.mark.parametrize("args", [(), (None,), (None, None), (3, 3, 3, 3)])
def test_configure_takes_keywords_only(extension, args):
    with pytest.raises(ERRORS):
        extension.configure(*args)


def test_configure_checks_every_field(extension):
    from treemode._pipeline import _callsite

    good = _callsite.configure_fields()
    assert tuple(good) == extension.CONFIGURE_FIELDS  # the one list of names, in C
    for name in good:
        missing = {k: v for k, v in good.items() if k != name}
        with pytest.raises(TypeError, match=name):
            extension.configure(**missing)
    for name, bad in [("raw_value", property()), ("trace_attr", None), ("array_types", [])]:
        with pytest.raises(TypeError, match="configure"):
            extension.configure(**{**good, name: bad})
    # The refused configurations left the configured one in place: a kernel runs.
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    flat = _flatten.flatten_arg(m, is_array)
    state = (flat.origin or flat)._guard.compiled_state
    assert extension.holds(state, list(flat.variables), m) is True


def _record_fields(**changes: Any) -> dict[str, Any]:
    fields = {
        "version": _border.RECORD_VERSION,
        "key": ("a key",),
        "slots": (None,),
        "partial_args": (),
        "kw_names": (),
        "closure_reads": ((),) * 7,
        "closure_holders": (),
        "lifted_slots": (),
        "jitted": len,
        "donated": None,
        "kept": None,
        "trace": None,
        "checked": (),
        "avals": (),
    }
    fields.update(changes)
    return fields


@pytest.mark.parametrize(
    "changes",
    [
        {"version": _border.RECORD_VERSION + 1},
        {"slots": [None]},
        {"slots": ("not a weak reference",)},
        {"partial_args": None},
        {"kw_names": ("x", 1)},
        {"closure_reads": ((),) * 6},
        {"closure_reads": ((),) * 6 + (None,)},
        {"closure_holders": (len,)},  # no slot for it
        {"jitted": 3},
        {"donated": (0,)},  # kept missing
        {"donated": (-1,), "kept": ()},
        {"donated": ("0",), "kept": ()},
        {"checked": (0,)},  # no aval for it
        {"checked": (-1,), "avals": (None,)},
        {"avals": [None]},
    ],
)
def test_fast_record_refuses_malformed_fields(extension, changes):
    with pytest.raises(ERRORS):
        extension.FastRecord(**_record_fields(**changes))
    record = extension.FastRecord(**_record_fields())  # the well-formed one
    assert record.slots == (None,) and record.jitted is len


def test_fast_record_fields_are_keyword_only_and_all_required(extension):
    assert extension.RECORD_FIELDS == tuple(_record_fields())  # the one list of names, in C
    with pytest.raises(TypeError):
        extension.FastRecord(*_record_fields().values())
    for name in extension.RECORD_FIELDS:
        fields = _record_fields()
        del fields[name]
        with pytest.raises(TypeError, match=name):
            extension.FastRecord(**fields)


def test_fast_call_misses_without_a_record_or_with_anything_else(extension):
    seen: list[Any] = []

    class Fn(extension.FastCall):
        pass

    f = Fn()
    with pytest.raises(TypeError):
        f(1)  # no miss set
    f._miss = 3
    with pytest.raises(TypeError):
        f(1)  # not callable
    f._miss = lambda self, error, args, kwargs: (
        seen.append((error, args, kwargs)) or ("missed", None)
    )
    assert f._records is None and f(1, k=2) == "missed"
    f._records = "not a list of records"
    assert f(2) == "missed"
    assert seen == [(None, (1,), {"k": 2}), (None, (2,), None)]
    # A record whose arguments do not match (two slots, one argument): a miss.
    f._records = [extension.FastRecord(**_record_fields(slots=(None, None)))]
    assert f(1) == "missed" and seen[-1] == (None, (1,), None)
    # Several records, none matching (and a non-record among them): each is tried,
    # then the miss.
    f._records = [
        extension.FastRecord(**_record_fields(slots=(None, None))),
        "not a record",
        extension.FastRecord(**_record_fields(slots=(None, None, None))),
    ]
    assert f(1) == "missed" and seen[-1] == (None, (1,), None)
    # A miss that does not return (out, record) is an error.
    f._miss = lambda self, error, args, kwargs: "not a pair"
    with pytest.raises(TypeError, match="returns"):
        f(1)


def test_the_miss_adds_its_record_to_the_table(extension):
    """The executor keeps what its misses return: first, one per key, at most
    RECORDS_BOUND; None adds nothing."""

    class Fn(extension.FastCall):
        pass

    f = Fn()
    f._records = []
    made: list[Any] = []

    def miss(self, error, args, kwargs):
        key = args[0]
        record = None if key is None else extension.FastRecord(**_record_fields(key=key))
        made.append(record)
        return ("out", record)

    f._miss = miss
    assert f(None) == "out" and f._records == []
    for key in (1, 2, 1):
        assert f(key) == "out"
    assert [r.key for r in f._records] == [1, 2]  # the newest record of key 1 replaced it
    assert f._records[0] is made[-1]
    for key in range(3, 3 + extension.RECORDS_BOUND):
        f(key)
    assert len(f._records) == extension.RECORDS_BOUND
    assert f._records[0].key == 2 + extension.RECORDS_BOUND
