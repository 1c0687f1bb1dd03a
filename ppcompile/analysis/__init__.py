"""What the passes ask of single ops (op matching, token locality, prefix causality) and of the split's
partition (spans no cut may split, tiny graph segments folded into breaks).

Helpers, not passes: they read FX nodes and their meta, never change a graph. They sit between the
config and the passes (``passes/`` imports them; they import nothing of ``passes/`` or later stages).
"""
