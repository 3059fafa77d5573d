"""A NIXL-compatible Python API on freight.

Code written for NIXL (``nixl_agent``, ``nixl_agent_config``, descriptor lists, NIXL's
exceptions) runs on freight by changing its import::

    from freight.nixl import nixl_agent, nixl_agent_config

or, unchanged, with the alias: :func:`install` (or the ``shim`` directory first on
``PYTHONPATH``, printed by ``python -m freight.nixl --shim-path``) makes ``import nixl``,
``nixl._api``, ``nixl._bindings``, ``nixl._utils`` and ``nixl.logging`` resolve here.
docs/nixl.md maps NIXL's backends to freight's transports and lists what is refused.
"""

from __future__ import annotations

import sys

from . import _api, _bindings, _utils, logging
from ._bindings import *  # noqa: F401,F403  (NIXL's namespace holds its bindings' names too)
from ._bindings import __all__ as _binding_names

# After the bindings' names: where both have one (nixl_thread_sync_t, DEFAULT_COMM_PORT),
# the package exports the Python API's, as __all__ says.
from ._api import (  # type: ignore[assignment]  # noqa: E402
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

__all__ = ["install", "shim_path", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
           "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle", "DEFAULT_COMM_PORT",
           *[n for n in _binding_names if n not in ("nixl_thread_sync_t", "DEFAULT_COMM_PORT")]]

_SUBMODULES = {"_api": _api, "_bindings": _bindings, "_utils": _utils, "logging": logging}


def install() -> None:
    """Makes ``import nixl`` (and its submodules) this package, for code written for NIXL.
    Call it before that code imports nixl; a real NIXL imported earlier is replaced."""
    me = sys.modules[__name__]
    sys.modules["nixl"] = me
    for name, module in _SUBMODULES.items():
        sys.modules[f"nixl.{name}"] = module


def shim_path() -> str:
    """A directory that, first on ``PYTHONPATH``, makes ``import nixl`` load freight's face."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
