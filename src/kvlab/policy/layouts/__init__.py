"""Cache layouts, one file each: which slots a cache keeps, and what every command does with them.

:mod:`~kvlab.policy.layouts.base` says what a layout answers; importing this package imports every other
module in it, so a layout written in a new file here is registered (:data:`LAYOUTS`) and read by every
command that takes ``--cache`` without touching any other file.
"""

import importlib
import pkgutil

from kvlab.policy.layouts.base import LAYOUTS, Items, Layout, Roll, serve_caches

for _module in pkgutil.iter_modules(__path__):  # sorted by name: full, rolling, scored, then the rest
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LAYOUTS", "Items", "Layout", "Roll", "serve_caches"]
