"""remat: JAX-style rematerialization for PyTorch that composes with torch.func."""

from . import _torch_private
from . import memory as memory
from . import policies as policies
from ._apply import apply as apply
from ._apply import checkpoint as checkpoint
from ._apply import unapply as unapply
from ._errors import RecomputeError as RecomputeError
from ._errors import debug as debug
from ._introspect import Residual as Residual
from ._introspect import print_saved_residuals as print_saved_residuals
from ._introspect import saved_residuals as saved_residuals
from ._transform import name as name
from ._transform import remat as remat

__all__ = [
    "RecomputeError",
    "Residual",
    "apply",
    "checkpoint",
    "debug",
    "memory",
    "name",
    "policies",
    "print_saved_residuals",
    "remat",
    "saved_residuals",
    "unapply",
]
__version__ = "0.1.0"

_torch_private.install()
