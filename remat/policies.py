"""Policies: what a remat region keeps for backward, and what it recomputes.

Pass a name (``policy="save_matmuls"``) or one of these objects to `remat.remat`.
Combine them with ``p | q`` (keep what either keeps) and ``p & q`` (keep what both
keep), or pass any callable taking an `OpCall` and returning a `bool` or a
`Decision`. Whatever the policy, a kept value is held only if a backward reads it.
"""

from ._policies import Decision as Decision
from ._policies import OpCall as OpCall
from ._policies import Policy as Policy
from ._policies import memory_budget as memory_budget
from ._policies import offload as offload
from ._policies import save_all_but_names as save_all_but_names
from ._policies import save_everything as save_everything
from ._policies import save_matmuls as save_matmuls
from ._policies import save_matmuls_no_batch as save_matmuls_no_batch
from ._policies import save_names as save_names
from ._policies import save_nothing as save_nothing
from ._policies import save_ops as save_ops

__all__ = [
    "Decision",
    "OpCall",
    "Policy",
    "memory_budget",
    "offload",
    "save_all_but_names",
    "save_everything",
    "save_matmuls",
    "save_matmuls_no_batch",
    "save_names",
    "save_nothing",
    "save_ops",
]
