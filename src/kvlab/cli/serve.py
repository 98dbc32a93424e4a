"""``kvlab serve``: an OpenAI-compatible server whose conversations roll instead of re-prefilling."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Annotated

import typer

from kvlab.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    capture_mode,
    capture_on,
    group_command,
    serve_cache_spec,
)
from kvlab.errors import BadInputError
from kvlab.serve.keys import check_keys

if TYPE_CHECKING:
    from kvlab.serve.connections import ConnectionLimits
    from kvlab.serve.engine import EngineSettings
    from kvlab.serve.tenants import KeyLimits


def _fraction(value: float) -> float:
    """Typer callback: a share in [0, 1] (NaN refused too), read before anything loads."""
    if not 0.0 <= value <= 1.0:
        raise typer.BadParameter(f"a fraction in [0, 1], got {value}")
    return value


def _wait_seconds(value: float) -> float:
    """Typer callback: seconds in [0, 60] (NaN refused too)."""
    if not 0.0 <= value <= 60.0:
        raise typer.BadParameter(f"seconds in [0, 60], got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """``kvlab serve``'s options: each field is one option, declared by its annotation (the command's
    parameters are these fields, in this order)."""

    model: ModelOpt = "smollm2-135m"
    device: DeviceOpt = "auto"
    dtype: DtypeOpt = "float32"
    host: Annotated[str, typer.Option(help="Interface to listen on (127.0.0.1: this machine only).")] = (
        "127.0.0.1"
    )
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000
    store: Annotated[
        str | None,
        typer.Option(
            help="Prefix store shared by requests and replicas: a folder, redis://host:port/db, or 'memory' (default).",
        ),
    ] = None
    window: Annotated[
        int | None, typer.Option(min=1, help="Recent tokens each conversation keeps (default 1024).")
    ] = None
    sinks: Annotated[
        int | None, typer.Option(min=0, help="Attention-sink tokens kept before the window (default 4).")
    ] = None
    evict_chunk: Annotated[
        int | None, typer.Option(min=1, help="Tokens evicted at once when a window overflows (default 64).")
    ] = None
    cache: Annotated[
        str | None,
        typer.Option(
            callback=serve_cache_spec,
            help="Cache policy of every conversation, instead of --window/--sinks/--evict-chunk: a sinks + "
            "window layout, in full precision or over a codec, e.g. sinks=4,window=2048,codec=kivi4 "
            "(sinks=N,window=N[,chunk=N][,codec=C[,tail=N]]), a scored layout that keeps its budget "
            "while decoding, e.g. h2o,budget=1024,every=64, or a strided layout, e.g. stride=4,recent=64. "
            "See docs/serving.md.",
        ),
    ] = None
    capture: Annotated[
        str,
        typer.Option(
            callback=capture_mode,
            help="Decode every conversation through one captured step over ring rows: compile (torch.compile, "
            "on a CPU too), cuda-graph (a GPU), auto (CUDA graphs on a GPU, compile on a CPU), or off (each "
            "conversation's own cache in one eager batched forward). Sinks + window caches in full precision. "
            "See docs/serving.md.",
        ),
    ] = "off"
    fidelity_sample: Annotated[
        float,
        typer.Option(
            callback=_fraction,
            help="Share of responses scored against the exact full cache (KL and top-1 agreement per response, "
            'computed at low priority; a request asks with "kvlab": {"fidelity": true}). See docs/serving.md.',
        ),
    ] = 0.0
    fidelity_wait: Annotated[
        float,
        typer.Option(
            callback=_wait_seconds,
            help="Seconds a scored reply (not streamed) waits for its score; later, kvlab.fidelity_url gives it.",
        ),
    ] = 0.5
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            help="Accepted Bearer key (repeatable; also $KVLAB_API_KEYS, comma-separated). Each key is its own tenant: no cache is shared across keys.",
        ),
    ] = None
    admin_key: Annotated[
        str | None,
        typer.Option(
            help="Key that opens the status page (/) and /metrics (also $KVLAB_ADMIN_KEY). With API keys or an admin key they need Authorization: Bearer ADMIN_KEY; tenants' keys do not open them.",
        ),
    ] = None
    max_batch: Annotated[int, typer.Option(min=1, help="Requests decoded together in one forward.")] = 4
    max_queue: Annotated[int, typer.Option(min=0, help="Requests waiting beyond those; more get 429.")] = 16
    max_sessions: Annotated[
        int,
        typer.Option(
            min=1,
            help="Idle conversations kept for reuse (each holds a window's cache; least recently used dropped).",
        ),
    ] = 64
    prefill_chunk: Annotated[
        int,
        typer.Option(
            min=1,
            help="Prompt tokens computed between two decode steps: a long prompt delays the others' next token by this much prefill at most.",
        ),
    ] = 256
    prefill_alone: Annotated[
        int,
        typer.Option(
            min=1,
            help="Prompt tokens computed per iteration while no conversation decodes (at least --prefill-chunk): a lone turn goes in few large forwards; a request arriving meanwhile waits this much prefill at most.",
        ),
    ] = 1024
    store_memory_mb: Annotated[
        int,
        typer.Option(
            min=1,
            help="Cap of the store's in-memory tier (MiB; least recently used blocks dropped beyond it).",
        ),
    ] = 2048
    max_prompt_tokens: Annotated[int, typer.Option(min=1)] = 32768
    max_tokens: Annotated[int, typer.Option(min=1, help="Largest max_tokens a request may ask for.")] = 2048
    max_body: Annotated[int, typer.Option("--max-body-bytes", min=1024)] = 1 << 20
    max_open_per_key: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Requests one API key may have open (queued + running; each prompt counts); more get 429. "
            "Default with 2+ keys: (--max-queue + --max-batch) // 2; else no cap of its own.",
        ),
    ] = None
    max_batch_per_key: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Requests of one API key served at once. Default with 2+ keys: --max-batch - 1 (a slot "
            "stays free for the other keys); else no cap of its own.",
        ),
    ] = None
    max_work_per_key: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tokens of work one API key may have in flight: prompt tokens + max_tokens of its open "
            "requests (more: 429; one request over it: 400). Default: 2 x (--max-prompt-tokens + --max-tokens).",
        ),
    ] = None
    max_logprob_entries: Annotated[
        int,
        typer.Option(
            min=1,
            help="Log-probabilities one request may ask for: scored tokens (echoed prompt, generated) x "
            "(1 + alternatives); more: 400 before anything is computed.",
        ),
    ] = 65536
    max_response_bytes: Annotated[
        int,
        typer.Option(
            min=1024,
            help="Bytes of one reply (a stream's, all together); a larger reply is an error instead.",
        ),
    ] = 8 << 20
    header_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=3600,
            help="Seconds a request's head (request line and headers) may take to arrive; then 408 and closed.",
        ),
    ] = 10.0
    body_timeout: Annotated[
        float, typer.Option(min=0.1, max=3600, help="Seconds a request's body may take after its head.")
    ] = 30.0
    idle_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=3600,
            help="Seconds a connection may wait between requests (or before its first) before it is closed.",
        ),
    ] = 5.0
    max_connections: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Open connections at most (default: min(1024, what the open-file limit allows)). At the cap the oldest connection without a complete request is closed.",
        ),
    ] = None
    max_per_client: Annotated[
        int,
        typer.Option(
            "--max-connections-per-client",
            min=1,
            help="Open connections per client address (behind a proxy, raise it to --max-connections).",
        ),
    ] = 64
    shutdown_timeout: Annotated[
        int,
        typer.Option(
            min=1,
            max=3600,
            help="Seconds a SIGTERM (or Ctrl+C) lets the requests running finish; those still running then "
            "are cut (a stream ends without [DONE]) and the server exits.",
        ),
    ] = 30


def serve(options: ServeOptions) -> None:
    """Serve the model over the OpenAI API (chat, completions, streaming) with rolling, shared caches.

    A conversation sent again with a new turn computes only the new tokens; one that outgrows the
    window rolls (sinks + window, exact RoPE re-rotation); prefixes are shared through the store by
    every request of a tenant and by every server on the same store. Status page at /, Prometheus
    metrics at /metrics. See docs/serving.md.
    """
    run_server(options)


def register(app: typer.Typer) -> None:
    app.command("serve")(group_command(serve))


def _keys(o: ServeOptions) -> tuple[tuple[str, ...], str | None]:
    """The API keys and the admin key (options, then environment), after refusing what the options cannot
    do: --cache with --window/--sinks/--evict-chunk, a bad key, an address this machine cannot listen on."""
    if o.cache is not None:
        given = [
            opt
            for opt, v in (("--window", o.window), ("--sinks", o.sinks), ("--evict-chunk", o.evict_chunk))
            if v is not None
        ]
        if given:
            raise BadInputError(
                f"--cache sets the cache policy itself; drop {', '.join(given)} "
                "(or write them into the spec: sinks=N,window=N,chunk=N)"
            )
    keys = tuple(o.api_key or ()) + tuple(k for k in os.environ.get("KVLAB_API_KEYS", "").split(",") if k)
    admin = o.admin_key or os.environ.get("KVLAB_ADMIN_KEY") or None
    check_keys(keys, admin)
    _check_can_listen(o.host, o.port)
    return keys, admin


def _settings(o: ServeOptions, keys: tuple[str, ...]) -> tuple[EngineSettings, KeyLimits]:
    """The engine's settings and the per-key caps they hold."""
    from kvlab.serve.engine import EngineSettings
    from kvlab.serve.tenants import default_key_limits

    per_key = default_key_limits(
        keys=len(set(keys)),
        max_queue=o.max_queue,
        max_batch=o.max_batch,
        max_prompt_tokens=o.max_prompt_tokens,
        max_tokens=o.max_tokens,
        max_open=o.max_open_per_key,
        max_batch_per_key=o.max_batch_per_key,
        max_work=o.max_work_per_key,
    )
    settings = EngineSettings(
        window=1024 if o.window is None else o.window,
        sinks=4 if o.sinks is None else o.sinks,
        evict_chunk=64 if o.evict_chunk is None else o.evict_chunk,
        max_batch=o.max_batch,
        max_queue=o.max_queue,
        max_sessions=o.max_sessions,
        prefill_chunk=o.prefill_chunk,
        prefill_alone=o.prefill_alone,
        cache=o.cache,
        fidelity_sample=o.fidelity_sample,
        fidelity_wait_s=o.fidelity_wait,
        max_open_per_key=per_key.max_open,
        max_batch_per_key=per_key.max_batch,
        max_work_per_key=per_key.max_work,
    )
    if o.capture != "off":  # the policy refused first (no torch), then auto read off the device
        settings.policy.captured_roll(o.capture)
        # on a CPU the compiled rows decode faster than eager (benchmarks/results/serve_decode.md): auto takes them
        settings = dataclasses.replace(settings, capture=capture_on(o.capture, o.device, on_cpu="compile"))
    return settings, per_key


def run_server(o: ServeOptions) -> None:
    """``kvlab serve`` with its options read: refusals first (one line, before torch is imported), then
    the model, the store, the engine and the app, served until SIGTERM or Ctrl+C."""
    keys, admin = _keys(o)
    # the refusals above read options only: a bad one is one line before torch is imported
    import gc
    import sys

    import uvicorn

    from kvlab.model import load_model
    from kvlab.serve.app import Limits, create_app
    from kvlab.serve.connections import (
        ConnectionGuard,
        ConnectionLimits,
        GuardedServer,
        protocol_class,
        resolve_max_connections,
        setup_logging,
    )
    from kvlab.serve.engine import Engine, check_settings
    from kvlab.serve.metrics import Metrics
    from kvlab.store import open_store

    conn_limits = ConnectionLimits(
        header_timeout=o.header_timeout,
        body_timeout=o.body_timeout,
        idle_timeout=o.idle_timeout,
        max_connections=resolve_max_connections(o.max_connections),
        max_per_client=o.max_per_client,
    )
    setup_logging()
    settings, per_key = _settings(o, keys)
    handle = load_model(o.model, device=o.device, dtype=o.dtype)
    check_settings(handle, settings)  # before the store creates a folder
    kv_store = open_store(o.store or "memory", memory_bytes=o.store_memory_mb * 2**20)
    engine = Engine(handle, settings, store=kv_store, metrics=Metrics())
    limits = Limits(
        max_body_bytes=o.max_body,
        max_prompt_tokens=o.max_prompt_tokens,
        max_tokens=o.max_tokens,
        max_logprob_entries=o.max_logprob_entries,
        max_response_bytes=o.max_response_bytes,
    )
    app_ = create_app(engine, model_id=o.model, api_keys=keys, admin_key=admin, limits=limits)
    # The objects that exist now (the model, its tokenizer: some 400,000) never become garbage: keep
    # them out of the cyclic collector, which otherwise walks them all at each full collection (a
    # 0.5-0.8 s pause holding the GIL whenever a large request body's objects trigger one).
    gc.freeze()
    # The engine's thread releases the GIL inside each torch op and waits to take it back from the event
    # loop's thread, which holds it up to the switch interval (5 ms by default) while it parses requests:
    # under a flood of refused requests, each of a prompt's hundreds of ops could wait that long. 0.5 ms
    # bounds the wait (tests/test_serve_tenants.py's flood, 2 cores: the p95 of a second key's time to first
    # token was 2.2-2.4x its solo median in 4 runs, against 2.4-2.9x in 7 runs with the default).
    sys.setswitchinterval(0.0005)
    guard = ConnectionGuard(conn_limits)
    config = uvicorn.Config(
        app_,
        host=o.host,
        port=o.port,
        http=protocol_class(guard),
        timeout_keep_alive=max(1, round(o.idle_timeout)),  # unused: the protocol's idle deadline rules
        log_config=None,  # uvicorn's loggers propagate to setup_logging's rate-limited handler
        log_level="warning",
        access_log=False,
        # without it, a stream whose client stops reading held the shutdown for ever (its send never ends)
        timeout_graceful_shutdown=o.shutdown_timeout,
    )
    server = GuardedServer(config, guard)
    _announce(o, settings, per_key, conn_limits, kv_store.describe(), engine.device_description())
    try:
        server.run()
    finally:
        engine.stop()


def _announce(
    o: ServeOptions,
    settings: EngineSettings,
    per_key: KeyLimits,
    conn_limits: ConnectionLimits,
    store: str,
    device: str,
) -> None:
    """The start-up lines on stderr: where the server listens, what it holds, its limits."""
    held = (
        f"window {settings.window} + {settings.sinks} sinks"
        if o.cache is None
        else f"cache {settings.policy.spec}: {settings.policy.describe()}"
    )
    typer.echo(
        f"kvlab serve: {o.model} on http://{o.host}:{o.port}/v1 ({store}, {held}, {device})",
        err=True,
    )
    typer.echo(
        f"kvlab serve: connections: at most {conn_limits.max_connections} "
        f"({conn_limits.max_per_client} per client); head {o.header_timeout:g} s, body {o.body_timeout:g} s, "
        f"idle {o.idle_timeout:g} s",
        err=True,
    )
    typer.echo(f"kvlab serve: per API key: {_describe_key_limits(per_key)}", err=True)


def _check_can_listen(host: str, port: int) -> None:
    """One clear line for a port in use or a host this machine does not have (before the model loads)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as exc:
        raise BadInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _describe_key_limits(per_key: KeyLimits) -> str:
    """The per-key caps in words, for the start-up lines."""

    def cap(n: int | None, what: str) -> str:
        return f"{n} {what}" if n is not None else f"{what}: the server's limit"

    return ", ".join(
        [
            cap(per_key.max_open, "requests open"),
            cap(per_key.max_batch, "running at once"),
            cap(per_key.max_work, "tokens of work in flight"),
        ]
    )
