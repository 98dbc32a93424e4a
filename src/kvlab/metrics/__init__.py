"""Metrics: comparing caches, distributions and generations, and the statistics around them."""

from kvlab.metrics.logits import js_divergence, kl_divergence, logit_cosine, nll, perplexity, topk_overlap
from kvlab.metrics.stats import Interval, bootstrap_ci, bootstrap_curve, wilson_ci
from kvlab.metrics.text import agreement_length, distinct_n, longest_repeated_ngram

__all__ = [
    "Interval",
    "agreement_length",
    "bootstrap_ci",
    "bootstrap_curve",
    "distinct_n",
    "js_divergence",
    "kl_divergence",
    "logit_cosine",
    "longest_repeated_ngram",
    "nll",
    "perplexity",
    "topk_overlap",
    "wilson_ci",
]
