"""Streaming with a rolling cache: perplexity over a long text per method, and endless generation."""

from kvlab.streaming.generate import StreamEvent, stream_generate
from kvlab.streaming.perplexity import (
    METHODS,
    StreamMethod,
    StreamResult,
    method_names,
    stream_nll,
    streaming_perplexity,
)

__all__ = [
    "METHODS",
    "StreamEvent",
    "StreamMethod",
    "StreamResult",
    "method_names",
    "stream_generate",
    "stream_nll",
    "streaming_perplexity",
]
