"""EAGLE-3 heads: the head as the drafter runs it (``head``), the layouts heads are published in (``layouts``),
where named heads live (``names``), and training one for any target (``train`` and the modules it uses;
docs/heads.md)."""

from graft_cli.heads.head import Eagle3Head, load_head
from graft_cli.heads.layouts import HeadConfig, expected_shapes, head_layers, layer_indices
from graft_cli.heads.names import SHIPPED, named_heads, resolve_head, user_heads_dir

__all__ = ["Eagle3Head", "HeadConfig", "SHIPPED", "expected_shapes", "head_layers", "layer_indices", "load_head",
           "named_heads", "resolve_head", "user_heads_dir"]
