"""A yardstick for cache quality: RULER-style long-context tasks, scored, under any cache policy.

* :mod:`kvlab.eval.tasks`: seeded, offline task generators (needles, variable tracking, common words,
  QA over the haystack), each a :class:`~kvlab.eval.tasks.Trial` of a context and a separate question;
* :mod:`kvlab.eval.score`: RULER's string-match rules (all / part), stated and tested;
* :mod:`kvlab.eval.run`: a trial under cache policies (``full``, ``snapkv:0.5``, ``int4`` ...), scored,
  with KL divergence and top-1 agreement against the full cache (:mod:`kvlab.metrics.divergence`).

See docs/eval.md.
"""

from kvlab.eval.score import score, string_match_all, string_match_part
from kvlab.eval.tasks import TASKS, Trial, make_trial

__all__ = ["TASKS", "Trial", "make_trial", "score", "string_match_all", "string_match_part"]
