"""``kvlab stream-ppl``, ``kvlab suffix``, ``kvlab generate`` and ``kvlab chat``: suffix caching in practice."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvlab.cli.common import (
    CAPTURED,
    MAX_COUNT,
    ModelOptions,
    SeedOpt,
    capture_mode,
    capture_on,
    count_option,
    experiment_command,
    finite,
    group_command,
    live_cache_specs,
    nonempty_texts,
    print_json,
    roll_specs,
    text_option,
)
from kvlab.errors import BadInputError

WindowOpt = Annotated[int, count_option("--window", "-w", help="Recent tokens kept (after the sinks).")]
SinksOpt = Annotated[
    int, count_option("--sinks", "-s", least=0, help="Attention-sink tokens kept forever (0 = plain window).")
]
ChunkOpt = Annotated[
    int | None,
    count_option(
        "--evict-chunk",
        help="Tokens evicted at once when the window is full (default: 64, or half the window).",
    ),
]


def _stream_sinks(value: list[int] | None) -> list[int] | None:
    """Typer callback: ``stream-ppl --sinks`` values among the measured ones (1, 2, 4, 8)."""
    for v in value or []:
        if v not in (1, 2, 4, 8):
            raise typer.BadParameter(f"{v} is not among the measured sink counts 1, 2, 4, 8")
    return value


CacheHelp = (
    "A cache policy spec, e.g. sinks=4,window=2048,codec=kivi4 or h2o,keep=0.5,every=256 "
    "(layout x codec; see docs/rolling-cache.md)"
)


def _check_rolling(model: str, window: int, sinks: int, system: str | None = None) -> None:
    """What a rolling cache of ``sinks`` + ``window`` on ``model`` cannot honour, refused before the
    weights load (the model's config and tokenizer suffice): sinks not fewer than the window, a cache
    reaching the model's maximum position, and (``kvlab chat --system``) a system prompt of half the
    window or more, the rule ``kvlab serve`` applies to its pinned system prompts."""
    if sinks >= window:
        raise BadInputError(
            f"--sinks ({sinks}) must be fewer than --window ({window}); e.g. --sinks 4 --window 256"
        )
    from kvlab.model.facts import load_config_file
    from kvlab.model.loading import resolve_model_dir

    path, _ = resolve_model_dir(model)
    if (path / "config.json").is_file():
        config = load_config_file(path / "config.json")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        max_pos = int(getattr(text, "max_position_embeddings", 0) or 0)
        if max_pos and sinks + window >= max_pos:
            raise BadInputError(
                f"sinks + window ({sinks + window}) must stay below the model's maximum position "
                f"({max_pos}); choose a smaller --window"
            )
    if system:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):
            return  # the model load says what is missing
        if not getattr(tokenizer, "chat_template", None):
            return
        prefix = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
        pinned = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        if pinned >= window // 2:
            raise BadInputError(
                f"the system prompt takes {pinned} tokens; it must stay below half the window "
                f"({window // 2}) so the conversation has room; pass a larger --window"
            )


def _token_stream(
    handle, ids, mode: str, window: int, sinks: int, chunk: int | None, temperature: float, seed: int
):
    """``(tokens(max_new, stops) -> iterator of token ids, cache)``: kvlab's loop over a RollingCache
    (``mode="off"``), or over a StaticRollingCache whose steps a RollingDecoder captures (the same rule)."""
    if mode == "off":
        from kvlab.streaming import stream_generate
        from kvlab.streaming.generate import feed

        cache = _rolling(handle, window, sinks, chunk)
        first = feed(handle, cache, ids)

        def rolling(max_new, stops):
            for ev in stream_generate(
                handle, cache, first, max_new, temperature=temperature, seed=seed, stop_ids=stops
            ):
                yield ev.token_id

        return rolling, cache
    from kvlab.hf.graphs import RollingDecoder
    from kvlab.hf.static_rolling import static_rolling_cache_for
    from kvlab.loop import Sampling, decode_loop

    static = static_rolling_cache_for(handle, window=window, sinks=sinks, evict_chunk=chunk)
    dec = RollingDecoder(handle, static, mode=mode)  # type: ignore[arg-type]
    first = dec.prefill(ids)[0]

    def captured(max_new, stops):
        sampling = Sampling(temperature=temperature, seed=seed)
        feed_one = dec.decode_feed()
        for step in decode_loop(
            lambda t: feed_one(t)[0], first, max_new, sampling=sampling, stop_ids=stops, feed_last=True
        ):
            yield step.token(0)

    return captured, static


def _rolling(handle, window: int, sinks: int, chunk: int | None):
    from kvlab.hf.rolling_cache import rolling_cache_for

    return rolling_cache_for(
        handle, window=window, sinks=sinks, evict_chunk=None if chunk is None else min(chunk, window)
    )


def _write_tokens(handle, tokens, stops, *, stream: bool) -> tuple[int, str]:
    """Consume ``tokens`` up to a stop (Ctrl-C ends it too): ``(steps, text)``, the text written to
    stdout as it comes (whole UTF-8 characters) when ``stream``."""
    n, pending, done = 0, [], []
    try:
        for token in tokens:
            n += 1
            if token in stops:
                break
            pending.append(token)
            text = handle.decode(pending)
            if stream and not text.endswith("\ufffd"):  # wait for a complete UTF-8 character
                sys.stdout.write(text)
                sys.stdout.flush()
                done += pending
                pending = []
    except KeyboardInterrupt:
        pass
    if stream:
        sys.stdout.write(handle.decode(pending) + "\n")
    return n, handle.decode(done + pending)


def _generate_policy(ctx: typer.Context, spec: str | None, model: str, capture: str):
    """``--cache SPEC`` as a CachePolicy (None without it), refused before the weights load where
    ``--sinks/--window/--evict-chunk`` are given too, its window does not fit, or ``--capture`` asks for
    a captured decode the spec's cache has none of (:meth:`~kvlab.policy.layouts.base.CachePolicy.captured_roll`)."""
    if spec is None:
        return None
    from kvlab.policy.spec import parse

    sources = {o: ctx.get_parameter_source(o) for o in ("sinks", "window", "evict_chunk")}
    given = [f"--{o.replace('_', '-')}" for o, src in sources.items() if src and src.name != "DEFAULT"]
    if given:
        raise BadInputError(
            f"--cache names the whole cache policy; drop {', '.join(given)} (e.g. --cache sinks=4,window=512)"
        )
    policy = parse(spec)
    roll = policy.captured_roll(capture) if capture in CAPTURED else policy.layout.rolls()
    if roll is not None:
        _check_rolling(model, roll.window, roll.sinks)
    return policy


def _rolled_window(policy, model: str, window: int, sinks: int, chunk: int | None):
    """``(window, sinks, chunk)`` of a captured ``--cache`` spec (checked by :func:`_generate_policy`), else
    of ``--window/--sinks/--evict-chunk``, refused here where the model cannot honour them."""
    roll = None if policy is None else policy.layout.rolls()
    if roll is not None:
        return roll.window, roll.sinks, roll.chunk or None
    _check_rolling(model, window, sinks)
    return window, sinks, None if chunk is None else min(chunk, window)


def _generate_with_policy(
    policy, prompt, max_new_tokens, temperature, chat, stats, json_out, model: ModelOptions, seed
) -> None:
    """``kvlab generate --cache SPEC``: the live cache :func:`~kvlab.policy.cache_for` builds,
    streamed (a RollingCache) or run through kvlab's decode loop (any other); says the policy and the
    K/V bytes held at the end and at most."""
    from kvlab.policy.spec import cache_for
    from kvlab.streaming.generate import HeldBytes, policy_generate

    handle = model.load()
    ids = handle.encode(prompt, chat=chat)
    cache, held = cache_for(policy, handle), HeldBytes()
    stops = handle.eos_ids() if chat else set()
    t0 = time.perf_counter()
    tokens = policy_generate(
        handle,
        cache,
        ids,
        max_new_tokens or None,
        temperature=temperature,
        seed=seed,
        stop_ids=sorted(stops),
        held=held,
    )
    n, text = _write_tokens(handle, tokens, stops, stream=not json_out)
    dt = time.perf_counter() - t0
    if json_out:
        doc = {"text": text, "tokens": n, "prompt_tokens": len(ids), "seconds": dt}
        print_json({**doc, "policy": policy.to_json(), **held.to_json()}, indent=None)
    if stats:
        sys.stderr.write(
            f"[{n} tokens in {dt:.1f} s, {n / max(dt, 1e-9):.1f} tokens/s; cache {policy.spec} "
            f"({type(cache).__name__}): {held.now / 2**20:.2f} MiB held, {held.peak / 2**20:.2f} MiB at most]\n"
        )


def stream_ppl_cmd(
    text_file: Annotated[
        Path | None,
        text_option("A UTF-8 text file (default: the shared books, else Python's documentation)."),
    ] = None,
    window: Annotated[
        list[int] | None, count_option("--window", "-w", help="Cache window size(s) (repeatable).")
    ] = None,
    sinks: Annotated[
        list[int] | None,
        typer.Option("--sinks", "-s", callback=_stream_sinks, help="Sink counts among 1,2,4,8 (repeatable)."),
    ] = None,
    tokens: Annotated[
        int | None,
        count_option("--tokens", least=2, help=f"Tokens of the text to stream (at most {MAX_COUNT:,})."),
    ] = None,
    samples: Annotated[
        int | None, count_option("--recompute-samples", help="Random targets re-computed exactly.")
    ] = None,
    stride: Annotated[
        int | None,
        count_option("--stride", help="Re-compute every STRIDE-th target instead of random samples."),
    ] = None,
    loop: Annotated[
        bool,
        typer.Option(
            "--loop",
            help="Feed a real RollingCache token chunk by chunk (the reference) instead of the masked forwards.",
        ),
    ] = False,
    cache: Annotated[
        list[str] | None,
        typer.Option(
            callback=live_cache_specs,
            help=CacheHelp + " (repeatable), scored next to the other methods.",
        ),
    ] = None,
) -> dict:
    """Perplexity over a text per cache policy: full, window, sinks + window, sliding window re-computed."""
    return {
        **({"caches": cache} if cache else {}),
        "text_file": text_file,
        "windows": window or None,
        "sinks": sinks or None,
        "tokens": tokens,
        "recompute_samples": samples,
        "recompute_stride": stride,
        "loop": loop,
    }


def suffix_cmd(
    text_file: Annotated[
        Path | None,
        text_option("A UTF-8 text file for the samples (default: a book or Python's documentation)."),
    ] = None,
    windows: Annotated[
        int | None, count_option("--samples", help="Text samples (windows), >= 20 by default.")
    ] = None,
    context: Annotated[
        int | None, count_option("--context", "-c", least=2, help="Tokens per sample before the roll.")
    ] = None,
    drop: Annotated[
        list[str] | None,
        typer.Option(
            "--roll",
            "-r",
            callback=roll_specs,
            help="Tokens rolled off: a count or a share like 25% (repeatable).",
        ),
    ] = None,
    sinks: Annotated[
        list[int] | None, count_option("--sinks", "-s", least=0, help="Sink counts (repeatable).")
    ] = None,
) -> dict:
    """Suffix caching: roll a cached context with/without sinks vs re-prefill and full context."""
    return {
        "text_file": text_file,
        "windows": windows,
        "context_tokens": context,
        "drops": drop or None,
        "sinks": sinks,
    }


def generate_cmd(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(callback=nonempty_texts, help="Prompt text.")],
    max_new_tokens: Annotated[
        int, count_option("--max-new-tokens", "-n", least=0, help="Tokens to generate (0 = until Ctrl-C).")
    ] = 200,
    window: WindowOpt = 512,
    sinks: SinksOpt = 4,
    evict_chunk: ChunkOpt = None,
    cache_spec: Annotated[
        str | None,
        typer.Option(
            "--cache",
            callback=live_cache_specs,
            help=CacheHelp + "; replaces --sinks/--window/--evict-chunk.",
        ),
    ] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", min=0.0, callback=finite, help="0 = greedy.")
    ] = 0.0,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the chat template.")] = False,
    stats: Annotated[
        bool, typer.Option("--stats", help="Print tokens/s, rolls and memory to stderr at the end.")
    ] = False,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON document at the end (text, tokens, seconds, the cache policy and "
            "the bytes it held) instead of streaming the text.",
        ),
    ] = False,
    model: ModelOptions = ModelOptions(),
    seed: SeedOpt = 0,
    capture: Annotated[
        str,
        typer.Option(
            callback=capture_mode,
            help="Decode steps captured: auto (CUDA graphs on a GPU, none on a CPU; none with --cache), "
            "cuda-graph, compile (torch.compile; with --cache, a sinks + window spec), off.",
        ),
    ] = "auto",
) -> None:
    """Stream tokens with constant memory: sinks + a rolling window (or any --cache policy)."""
    policy = _generate_policy(ctx, cache_spec, model.model, capture)
    if policy is not None and capture not in CAPTURED:
        return _generate_with_policy(
            policy, prompt, max_new_tokens, temperature, chat, stats, json_out, model, seed
        )
    mode = capture_on(capture, model.device)
    window, sinks, chunk = _rolled_window(policy, model.model, window, sinks, evict_chunk)
    handle = model.load()
    ids = handle.encode(prompt, chat=chat)
    tokens, cache = _token_stream(handle, ids, mode, window, sinks, chunk, temperature, seed)
    t0 = time.perf_counter()
    stops = handle.eos_ids() if chat else set()
    n, text = _write_tokens(handle, tokens(max_new_tokens or None, stops), stops, stream=not json_out)
    if json_out:
        doc = {"text": text, "tokens": n, "seconds": time.perf_counter() - t0, "cache": cache.describe()}
        doc.update({"policy": policy.to_json()} if policy is not None else {})
        print_json({**doc, "held_bytes": cache.nbytes}, indent=None)
    if stats:
        dt = time.perf_counter() - t0
        sys.stderr.write(
            f"[{n} tokens in {dt:.1f} s, {n / max(dt, 1e-9):.1f} tokens/s; {cache.describe()}; "
            f"cache {cache.nbytes / 2**20:.1f} MiB]\n"
        )


def chat_cmd(
    window: WindowOpt = 1024,
    sinks: SinksOpt = 4,
    evict_chunk: ChunkOpt = None,
    max_new_tokens: Annotated[int, count_option("--max-new-tokens", "-n", help="Longest reply.")] = 256,
    system: Annotated[str, typer.Option(help="System prompt (kept as the sinks' neighbourhood).")] = "",
    model: ModelOptions = ModelOptions(),
) -> None:
    """Interactive chat whose context rolls (suffix caching) instead of being re-prefilled. Ctrl-D quits."""
    from kvlab.streaming import stream_generate
    from kvlab.streaming.generate import feed

    _check_rolling(model.model, window, sinks, system)
    handle = model.load()
    if handle.tokenizer is None or not getattr(handle.tokenizer, "chat_template", None):
        from kvlab.errors import UnsupportedModelError

        raise UnsupportedModelError("kvlab chat needs a tokenizer with a chat template")
    cache = _rolling(handle, window, sinks, evict_chunk)
    stops = handle.eos_ids()
    interactive = sys.stdin.isatty()
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    unterminated = False
    sys.stderr.write(f"kvlab chat: {handle.name}, {sinks} sinks + window {window} (Ctrl-D to quit)\n")
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
            line.encode("utf-8")  # undecodable bytes arrive as surrogates under some locales
        except (UnicodeDecodeError, UnicodeEncodeError) as exc:
            raise BadInputError(f"stdin is not UTF-8 text (character {exc.start} of a line)") from None
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        # Only the new turn is tokenized and fed: the earlier turns live in the rolling cache.
        turn = handle.tokenizer.apply_chat_template(
            history + [{"role": "user", "content": line}], add_generation_prompt=True, tokenize=False
        )
        prefix = handle.tokenizer.apply_chat_template(history, tokenize=False) if history else ""
        new_text = turn[len(prefix) :] if turn.startswith(prefix) else turn
        new_ids = handle.tokenizer(new_text, add_special_tokens=False)["input_ids"]
        if unterminated:  # the last reply hit --max-new-tokens: close it as the template would
            new_ids = [handle.tokenizer.eos_token_id, *new_ids]
        rolls0, rebases0 = cache.rolls, cache.rebases
        t0 = time.perf_counter()
        first = feed(handle, cache, new_ids)
        reply: list[int] = []
        unterminated = True
        for ev in stream_generate(handle, cache, first, max_new_tokens, stop_ids=sorted(stops)):
            if ev.token_id in stops:
                unterminated = False
                break
            reply.append(ev.token_id)
        dt = time.perf_counter() - t0
        text = handle.decode(reply).strip()
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]
        rolled = cache.rolls - rolls0
        note = f", rolled {rolled}x" if rolled else ""
        note += f", re-based {cache.rebases - rebases0}x" if cache.rebases > rebases0 else ""
        sys.stderr.write(
            f"[{len(reply)} tokens, {len(reply) / max(dt, 1e-9):.1f} tokens/s; {cache.kept} tokens in "
            f"cache, {cache.tokens_seen} seen{note}]\n"
        )
    sys.stderr.write("bye\n")


def register(app: typer.Typer) -> None:
    experiment_command(app, "stream-ppl", "streaming_ppl")(stream_ppl_cmd)
    experiment_command(app, "suffix", "suffix_caching")(suffix_cmd)
    app.command("generate")(group_command(generate_cmd))
    app.command("chat")(group_command(chat_cmd))
