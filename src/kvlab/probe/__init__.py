"""``kvlab probe``: a black-box audit of an OpenAI-compatible server's caching, over HTTP only.

Does a cache hit answer as a miss does (:mod:`kvlab.probe.checks`), is one tenant's cache kept from
another, and does what the server claims cached match its timing (:mod:`kvlab.probe.timing`)? Each check
is a :class:`~kvlab.probe.report.Section` of the report (``report.json``, ``report.html``). A pure HTTP
client: no torch, no transformers. See docs/serving.md ("Probing a server").
"""

from kvlab.probe.config import ProbeConfig
from kvlab.probe.run import run_probe

__all__ = ["ProbeConfig", "run_probe"]
