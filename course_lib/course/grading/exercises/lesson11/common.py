"""What the parts of lesson 11's checks share: the parts' notebooks, and the layout's three axes
(11a's groups and 11b's stand-in layout)."""

from __future__ import annotations

PART_A, PART_B, PART_C = "11a_layout_precision", "11b_train_step", "11c_learn_build_buy"
AXES = ("pp", "dp", "tp")
