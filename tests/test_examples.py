"""Every program in ``examples/`` runs to completion, and matches its Flax original.

Each example runs in its own Python process (the way a user runs it), with 8
virtual CPU devices so the data-parallel example finds its mesh, and must exit
with status 0 within the time limit. The examples print their own metrics and
``assert`` the results they advertise (the loss falls, state advances, the
sharded step matches the single-device one).

The examples written after programs of Flax's ``examples/nnx_toy_examples/``
(``vae.py``, ``fsdp.py``, ``scan_mlp.py``) are also imported here and trained on
the same data as the Flax original, which tests/flax_programs.py runs with Flax's
graph-mode transforms: the losses of every step must agree to 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import flax_programs
import jax
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 300  # a hang guard: each example finishes in well under a minute alone, but
# the suite runs them beside other workers (one took over 120 s on 2 shared cores)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def test_there_are_examples() -> None:
    assert EXAMPLES, "examples/ holds no programs"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    try:
        proc = subprocess.run(
            [sys.executable, str(path)],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{path.name} did not finish within {TIMEOUT_S} s:\n{e.stdout or ''}")
    assert proc.returncode == 0, (
        f"{path.name} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )


# -- the examples against their Flax originals --------------------------------


def _load_example(name: str):
    """Import ``examples/<name>.py`` as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"treemode_example_{name}", ROOT / "examples" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while building classes
    spec.loader.exec_module(module)
    return module


def _assert_losses_match(ours: list[float], flax: list[float], steps: int) -> None:
    assert len(ours) == len(flax) == steps
    assert len(set(ours)) > 1, "the losses do not change: nothing was trained"
    np.testing.assert_allclose(ours, flax, atol=1e-5, rtol=1e-5)


def _arrays(tree) -> list[np.ndarray]:
    """The leaves of a state as numpy arrays (key arrays as their key data)."""
    leaves = jax.tree.leaves(tree)
    return [
        np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        for x in leaves
    ]


def test_vae_matches_flax_original() -> None:
    """05_vae.py: the KL term through ``capture`` instead of an attribute set and popped."""
    vae = _load_example("vae")
    batches = vae.make_batches()
    model, ours = vae.train(batches)
    flax = flax_programs.vae_losses(batches, vae.IMAGE_SHAPE, vae.HIDDEN, vae.LATENT)
    _assert_losses_match(ours, flax, vae.STEPS)
    assert int(model.encoder.rngs.noise.count[...]) == vae.STEPS


def test_fsdp_matches_flax_original() -> None:
    """10_fsdp_and_optimizer.py: sharded Params and momentum on a 2 x 4 mesh."""
    assert len(jax.devices()) == 8
    fsdp = _load_example("fsdp")
    batches = fsdp.make_batches()
    model, optimizer, ours = fsdp.train(batches)
    flax, final = flax_programs.fsdp_losses(batches, fsdp.DIN, fsdp.DMID, fsdp.DOUT)
    _assert_losses_match(ours, flax, fsdp.STEPS)
    for name in ("w1", "b1", "w2"):
        param, momentum = getattr(model, name)[...], optimizer.momentum[name][...]
        np.testing.assert_allclose(param, final[name], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(momentum, final[f"momentum.{name}"], atol=1e-5, rtol=1e-5)
        # Sharded as in the original, by the Variables' metadata.
        assert param.sharding.spec == final[name].sharding.spec
        assert momentum.sharding.spec == final[name].sharding.spec
    assert model.w1[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_scan_mlp_matches_flax_original() -> None:
    """06_scan_over_layers.py: BatchNorm and Dropout state updated inside the scan."""
    scan_mlp = _load_example("scan_mlp")
    batches = scan_mlp.make_batches()
    model, ours = scan_mlp.train(batches)
    flax, state = flax_programs.scan_mlp_losses(batches, scan_mlp.DIM, scan_mlp.N_LAYERS)
    _assert_losses_match(ours, flax, scan_mlp.STEPS)
    # Every Variable ends equal: Params, BatchNorm statistics, Dropout key counts.
    ours_state, flax_state = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(state)
    assert jax.tree.structure(ours_state) == jax.tree.structure(flax_state)
    for a, b in zip(_arrays(ours_state), _arrays(flax_state), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    counts = np.asarray(model.layers.dropout.rngs.count[...])
    assert (counts == counts[0]).all() and counts[0] > 0
