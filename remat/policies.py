"""Policies: what a remat region keeps for backward, and what it recomputes.

Pass a name (``policy="save_nothing"``) or one of these objects to `remat.remat`.
"""

from ._policies import Decision as Decision
from ._policies import OpCall as OpCall
from ._policies import Policy as Policy
from ._policies import save_everything as save_everything
from ._policies import save_nothing as save_nothing

__all__ = ["Decision", "OpCall", "Policy", "save_everything", "save_nothing"]
