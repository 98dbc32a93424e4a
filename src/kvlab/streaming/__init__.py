"""Streaming with a rolling cache: perplexity over a long text per method, and endless generation."""

from kvlab.streaming.generate import StreamEvent, stream_generate
from kvlab.streaming.perplexity import (
    METHODS,
    TABLE_COLUMNS,
    StreamMethod,
    StreamResult,
    stream_nll,
    streaming_perplexity,
    subsample_targets,
    summarize,
    table_row,
)

__all__ = [
    "METHODS",
    "TABLE_COLUMNS",
    "StreamEvent",
    "StreamMethod",
    "StreamResult",
    "stream_generate",
    "stream_nll",
    "streaming_perplexity",
    "subsample_targets",
    "summarize",
    "table_row",
]
