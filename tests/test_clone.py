"""treemode.clone: new Variables, shared or independent buffers, sharing kept."""

from __future__ import annotations

import numpy as np
from flax import nnx
from helpers import Stateful, assert_same_state

import treemode


def test_clone_new_variables_shared_buffers_by_default():
    model = Stateful(nnx.Rngs(0))
    copy = treemode.clone(model)
    assert copy.linear.kernel is not model.linear.kernel
    assert copy.linear.kernel.get_raw_value() is model.linear.kernel.get_raw_value()
    copy.linear.kernel[...] += 1
    assert not np.allclose(copy.linear.kernel[...], model.linear.kernel[...])


def test_clone_arrays_true_gives_independent_buffers():
    model = Stateful(nnx.Rngs(0))
    copy = treemode.clone(model, arrays=True)
    assert_same_state(model, copy)
    a = model.linear.kernel.get_raw_value()
    b = copy.linear.kernel.get_raw_value()
    assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()


def test_clone_preserves_sharing():
    class Tied(nnx.Module):
        def __init__(self):
            self.enc = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.dec = self.enc

    copy = treemode.clone(Tied(), arrays=True)
    assert copy.enc is copy.dec
