"""Codecs added one file each: every module here defines a :class:`~kvlab.policy.quant.Quantizer`
subclass with its own ``kind``, which registers it (``fp8.py`` is the example)."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
