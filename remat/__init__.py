"""remat: JAX-style rematerialization for PyTorch that composes with torch.func."""

from . import memory as memory
from . import policies as policies
from ._errors import RecomputeError as RecomputeError
from ._errors import debug as debug
from ._transform import remat as remat

__all__ = ["RecomputeError", "debug", "memory", "policies", "remat"]
__version__ = "0.1.0"
