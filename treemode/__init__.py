"""treemode: tree-mode transforms for Flax NNX, Equinox and plain pytrees."""

from importlib import metadata as _importlib_metadata

from ._versions import VersionWarning as VersionWarning
from ._versions import check_installed as _check_installed

# Before anything imports JAX or Flax: an unsupported version is named here
# rather than failing later with an internal error.
_check_installed()

from ._accel import _compiled
from ._accel._compiled import ExtensionStatus as ExtensionStatus
from ._accel._compiled import ExtensionWarning as ExtensionWarning
from ._accel._compiled import extension_status as extension_status
from ._caches import clear_caches as clear_caches
from ._errors import AliasError as AliasError
from ._errors import ArgnumsError as ArgnumsError
from ._errors import AxisError as AxisError
from ._errors import ClosureError as ClosureError
from ._errors import CycleError as CycleError
from ._errors import DeletedArrayError as DeletedArrayError
from ._errors import DonationError as DonationError
from ._errors import MutationError as MutationError
from ._errors import ProxyError as ProxyError
from ._errors import StaticArgumentError as StaticArgumentError
from ._errors import StructureError as StructureError
from ._errors import TraceContextError as TraceContextError
from ._errors import TreemodeError as TreemodeError
from ._helpers._capture import capture as capture
from ._helpers._clone import clone as clone
from ._helpers._filter import filter as filter
from ._helpers._rngs import fork_rngs as fork_rngs
from ._helpers._rngs import split_rngs as split_rngs
from ._transforms._checkify import checkify as checkify
from ._transforms._cond import cond as cond
from ._transforms._cond import switch as switch
from ._transforms._control_flow import fori_loop as fori_loop
from ._transforms._control_flow import while_loop as while_loop
from ._transforms._custom_vjp import CustomVjp as CustomVjp
from ._transforms._custom_vjp import custom_vjp as custom_vjp
from ._transforms._eval_shape import eval_shape as eval_shape
from ._transforms._grad import grad as grad
from ._transforms._grad import value_and_grad as value_and_grad
from ._transforms._jit import JitWrapped as JitWrapped
from ._transforms._jit import jit as jit
from ._transforms._jit import jit_partial as jit_partial
from ._transforms._metadata import transform_metadata as transform_metadata
from ._transforms._pmap import pmap as pmap
from ._transforms._prefix_helpers import partition_specs as partition_specs
from ._transforms._prefix_helpers import prefix as prefix
from ._transforms._prefix_helpers import sharding_of as sharding_of
from ._transforms._remat import checkpoint as checkpoint
from ._transforms._remat import remat as remat
from ._transforms._rng_hints import BroadcastRngsWarning as BroadcastRngsWarning
from ._transforms._scan import scan as scan
from ._transforms._scan_axes import Carry as Carry
from ._transforms._shard_map import shard_map as shard_map
from ._transforms._vjp import jvp as jvp
from ._transforms._vjp import vjp as vjp
from ._transforms._vmap import vmap as vmap
from ._tree._closure import ClosureWarning as ClosureWarning
from ._tree._flatten import check_no_aliases as check_no_aliases
from ._tree._graph import from_tree as from_tree
from ._tree._graph import to_tree as to_tree
from ._tree._pytree import Pytree as Pytree
from ._tree._pytree_def import ModuleKey as ModuleKey
from ._tree._pytree_def import PytreeDef as PytreeDef

# One ExtensionWarning where the compiled extension is off but not by choice
# (treemode.extension_status() says why).
_compiled.announce(_compiled.STATUS)

try:
    __version__ = _importlib_metadata.version("treemode")  # declared in pyproject.toml
except _importlib_metadata.PackageNotFoundError:  # a source checkout on sys.path, not installed
    __version__ = "0+unknown"
