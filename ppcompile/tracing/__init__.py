"""Trace aids: what the user marks and declares, and the layers traced once.

- ``marks``: ``mark_token_dynamic``, ``mark_first_call``, ``TokenMarking`` (the token dim of each input).
- ``regions``: declared regions (``eager_region``, ``opaque_module``, ``token_local``) and the library
  regions known without a declaration (HF's sparse-MoE blocks, the mixers).
- ``layer_regions``, ``layer_stamps``, ``layer_stamp_checks``: ``trace_layers_once``, which traces one
  exemplar per group of equal layers and stamps the others, with the checks that keep a stamp honest.
- ``marker_ops``: the copies a traced-once region is called through.

The wing leaves marker ops in the graph Dynamo hands the backend; a pass removes each before the split
(``MARKER_OPS``, checked by ``tests/tracing/test_marker_ops.py``). ``ppcompile::opaque_module`` is not a
marker: it is the break an opaque module becomes, and it stays.

This ``__init__`` imports nothing, so that a pass importing ``tracing.regions`` loads no more than that.
"""

from __future__ import annotations

__all__ = ["MARKER_OPS"]

# Marker op -> the pass (``passes/manager.PASSES``) that removes it from the graph.
MARKER_OPS: dict[str, str] = {
    "ppcompile::region_copy": "inline_nested_regions",
    "ppcompile::region_write_back": "inline_nested_regions",
    "ppcompile::layer_input": "expand_stamped_layers",
    "ppcompile::layer_output": "expand_stamped_layers",
    "ppcompile::stamped_layer": "expand_stamped_layers",
}
