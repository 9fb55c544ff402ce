"""Every function the compiled extension exports refuses malformed input with an error.

treemode builds the extension's inputs itself, but a malformed one (a bug, or a
caller reaching into ``treemode._accel._compiled``) must raise ``TypeError`` or
``ValueError``, never crash the interpreter. Runs where the extension is on.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax.numpy as jnp
import pytest
from flax import nnx

from treemode._accel import _compiled

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


def _slow(entry: Any, obj: Any) -> list[Any] | None:
    return None


class _Entry:
    """A flattening whose ``_fast`` is malformed."""

    def __init__(self, fast: Any):
        self._fast = fast


@pytest.mark.parametrize(
    "args",
    [
        (),
        (None, [], [], [], set(), _slow),
        ((), [], None, [], set(), _slow),
        ((), [], [], None, set(), _slow),
        ((), [], [], [], [], _slow),
        ((), [], [], [], set(), None),
        ((), None, [], [], set(), _slow),
        (("not a weakref",), [1], [], [], set(), _slow),
    ],
)
def test_match_into_arguments(extension, args):
    with pytest.raises(ERRORS):
        extension.match_into(*args)


@pytest.mark.parametrize(
    "fast",
    [
        ("x", (), ()),  # no weak reference to the argument
        (None, (), "variables"),
        (weakref.ref(Plain), ("a",) * 15, ()),  # a malformed guard state
    ],
)
def test_match_into_malformed_fast_state(extension, fast):
    entry = _Entry(fast)
    if fast[0] is not None and isinstance(fast[0], weakref.ref):
        obj = Plain  # the argument the weak reference points to
    else:
        obj = Plain
    with pytest.raises(ERRORS):
        extension.match_into((weakref.ref(entry),), [obj], [], [], set(), _slow)


@pytest.mark.parametrize(
    "args",
    [
        (),
        (None, {}, 0, object(), object()),
        ((),) * 5,
        (((),) * 7, None, 0, object(), object()),
        (("x",) * 7, {}, 0, object(), object()),
        (((), (), (), (), (), ("pair",), ()), {}, 0, object(), object()),
        (((), (), (), (), (), (), ("triple",)), {}, 0, object(), object()),
    ],
)
def test_reads_hold_arguments(extension, args):
    with pytest.raises(ERRORS):
        extension.reads_hold(*args)


@pytest.mark.parametrize(
    "args", [(), (None, None), ([nnx.Param(1.0)], [1, 2]), (3, []), ([], 3), ([Plain()], [1])]
)
def test_write_changed_arguments(extension, args):
    with pytest.raises((*ERRORS, AttributeError)):
        extension.write_changed(*args)


def test_write_changed_leaves_a_variable_alone_on_error(extension):
    v = nnx.Param(jnp.zeros(2))
    before = v.get_raw_value()
    with pytest.raises(AttributeError):
        extension.write_changed([v, Plain()], [jnp.ones(2), 1])
    assert v.get_raw_value() is before


@pytest.mark.parametrize("args", [(), (None,), (None, None), (3, 3, 3, 3)])
def test_configure_arguments(extension, args):
    with pytest.raises(ERRORS):
        extension.configure(*args)


def test_configure_checks_every_record_field(extension):
    good_layout = _compiled.layout()
    with pytest.raises(TypeError, match="layout"):
        extension.configure(good_layout._replace(raw_value=property()), None)
    with pytest.raises(TypeError, match="layout"):
        extension.configure(good_layout._replace(current_trace_attr=None), None)
    with pytest.raises(TypeError, match="call_path"):
        extension.configure(good_layout, ("x",) * 11)
    # The refused configurations left the configured one in place.
    v = nnx.Param(jnp.zeros(2))
    new = jnp.ones(2)
    assert extension.write_changed([v], [new]) == 1 and v.get_raw_value() is new


@pytest.mark.parametrize(
    "memo",
    [
        3,
        (),
        (None, None),
        (None, None, ()),
        (None, None, ("site", "entry")),
        (None, None, ((None,) * 6, (None,) * 5)),
        (None, None, ((None, (), (), (), [], ()), (len, None, None, None, "donation"))),
    ],
)
def test_memo_call_refuses_a_malformed_plan(extension, memo):
    class Fn(extension.MemoCall):
        def _call(self, *args: Any) -> Any:
            return "python"

    f = Fn()
    with pytest.raises(ERRORS):
        f._memo = memo
    assert f._memo is None and f(1) == "python"


def test_site_call_fields_arguments(extension):
    with pytest.raises(TypeError):
        extension.SiteCallFields()
    with pytest.raises(TypeError):
        extension.SiteCallFields(1, 2, 3)
