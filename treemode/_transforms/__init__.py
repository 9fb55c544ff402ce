"""The layer `treemode._transforms`: the transforms: what is special about each JAX transform.

Layers, bottom first: the top level (foundations), `_accel`, `_tree`, `_pipeline`, `_transforms`,
`_helpers`; a module imports only its own layer and lower ones (tests/test_layers.py). Nothing is
re-exported here: import each name from the module that defines it.
"""
