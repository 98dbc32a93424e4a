"""The study: experiments on the library, the runner that orders them, and the report they write.

This package sits above the library (``kvlab.cache``, ``kvlab.ops``, ``kvlab.model`` ...): it imports
the library, the library never imports it (``tests/test_layering.py``). ``kvlab.cli`` sits above both.
"""
