"""``kvlab store ...``: put, find, list, check and clean a KV store; generate with reuse.

The default store is a local folder (``$KVLAB_STORE`` or ``~/.cache/kvlab/store``); ``--store PATH``
picks another folder and ``--store redis://host:port/db`` a shared Redis server.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvlab.cli.common import (
    JsonOpt,
    ModelOptions,
    console,
    experiment_command,
    group_command,
    print_json,
    print_table,
    refuse_errors,
    text_option,
)
from kvlab.errors import BadInputError

StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="Store folder, or redis://host:port/db (default: ~/.cache/kvlab/store)."),
]
RedisOpt = Annotated[
    str | None, typer.Option("--redis", help="Also use this Redis server as a shared tier behind the folder.")
]
BlockOpt = Annotated[
    int,
    typer.Option("--block-tokens", min=1, help="Tokens per block (must match the store's blocks to hit)."),
]
SaltOpt = Annotated[
    str | None, typer.Option("--salt", help="Tenant salt: caches are only shared within one salt.")
]

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """``"512M"`` -> 536870912; plain integers are bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise BadInputError(f"cannot read a size from {text!r}; write e.g. 500M or 2G") from None
    if not math.isfinite(value) or value <= 0 or value * _UNITS[unit] >= 2**63:
        raise BadInputError(f"a size must be a positive number of bytes below 8 EiB, got {text!r}")
    return int(value * _UNITS[unit])


def _size(value: str | None) -> str | None:
    """Typer callback for ``--max-bytes``: a size :func:`parse_bytes` reads, checked before the store opens."""
    if value is not None:
        refuse_errors(parse_bytes, value)
    return value


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """``--store --redis --json``: the option group (:func:`~kvlab.cli.common.group_command`) of the store
    a command opens and how it prints."""

    store: StoreOpt = None
    redis: RedisOpt = None
    json_out: JsonOpt = False

    def open(self, *, create: bool, block_tokens: int = 64, disk_bytes: str | None = None) -> Any:
        from kvlab.store import open_store

        kw: dict[str, Any] = {}
        if disk_bytes:
            kw["disk_bytes"] = parse_bytes(disk_bytes)
        return open_store(self.store, redis_url=self.redis, create=create, block_tokens=block_tokens, **kw)

    def emit(self, doc: Any) -> None:
        """JSON on stdout for machines (``--json``), aligned ``key: value`` lines for people."""
        if self.json_out:
            print_json(doc, default=str)
            return
        for line in _lines(doc):
            console.print(line, markup=False, highlight=False)


def _lines(doc: Any, indent: str = "") -> list[str]:
    if isinstance(doc, dict):
        out = []
        width = max((len(str(k)) for k in doc), default=0)
        for k, v in doc.items():
            if isinstance(v, dict | list) and v:
                out.append(f"{indent}{k}:")
                out.extend(_lines(v, indent + "  "))
            else:
                shown = (
                    f"{v:,}"
                    if isinstance(v, int) and not isinstance(v, bool)
                    else ("-" if v in ({}, []) else v)
                )
                out.append(f"{indent}{str(k) + ':':<{width + 1}} {shown}")
        return out
    if isinstance(doc, list):
        return [
            line
            for item in doc
            for line in _lines(item, indent + "- " if not isinstance(item, dict) else indent)
        ]
    return [f"{indent}{doc}"]


def _resolve(st: Any, prefix: str) -> str:
    """A full block hash from any unique prefix of it (as `kvlab store ls` prints 16 characters)."""
    from kvlab.store.errors import BlockNotFoundError
    from kvlab.store.inventory import list_blocks

    p = prefix.strip().lower()
    if not p or any(c not in "0123456789abcdef" for c in p):
        raise BadInputError(f"{prefix!r} is not a block hash (hex digits, as `kvlab store ls` prints)")
    if len(p) == 64:
        return p
    found = sorted({r["hash"] for r in list_blocks(st) if r["hash"].startswith(p)})
    if not found:
        raise BlockNotFoundError(f"no block starts with {p} in this store (see `kvlab store ls`)")
    if len(found) > 1:
        raise BadInputError(f"{p} is ambiguous: {len(found)} blocks start with it; give more characters")
    return found[0]


def put_cmd(
    text: Annotated[str | None, typer.Argument(help="Text to prefill and store.")] = None,
    file: Annotated[Path | None, text_option("Read the text from a UTF-8 file.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the text as a one-turn chat.")] = False,
    at: StoreOptions = StoreOptions(),
    block_tokens: BlockOpt = 64,
    salt: SaltOpt = None,
    model: ModelOptions = ModelOptions(),
) -> None:
    """Prefill TEXT and store its cache as blocks (blocks already stored are skipped)."""
    from kvlab.data import read_text_file

    if (text is None) == (file is None):
        raise BadInputError("give the text as an argument or with --text, not both or neither")
    body = read_text_file(file).text if file is not None else text or ""
    if not body.strip():
        raise BadInputError("the text is empty")
    # model and prefill first: a failure there must not leave a new, empty store folder behind
    h = model.load()
    ids = h.encode(body, chat=chat)
    snap = h.prefill(ids, all_logits=False).snapshot
    st = at.open(create=True, block_tokens=block_tokens)
    rep = st.put(snap, salt=salt, model=h)
    at.emit(
        {
            "store": st.describe(),
            "tokens": len(ids),
            "blocks_written": rep.blocks_written,
            "blocks_present": rep.blocks_present,
            "blocks_skipped": rep.blocks_skipped,
            "bytes_written": rep.bytes_written,
            "last_block": rep.hashes[-1],
        }
    )
    if rep.blocks_skipped:  # Redis down, paused or full: what was written is intact, the rest is not
        sys.stderr.write(
            f"kvlab store put: {rep.blocks_skipped} block(s) could not be stored (a tier failed; "
            "see the warning above)\n"
        )
        raise typer.Exit(1)


def get_cmd(
    block: Annotated[str, typer.Argument(help="Block hash (from `kvlab store ls`).")],
    out_file: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the prefix ending at BLOCK as a snapshot file.")
    ] = None,
    at: StoreOptions = StoreOptions(),
) -> None:
    """Rebuild the cached prefix that ends with BLOCK (and optionally save it as a .kv.safetensors file)."""
    from kvlab.cache import save_snapshot

    if out_file is not None and (out_file.is_dir() or not out_file.parent.is_dir()):
        raise BadInputError(f"--out {out_file}: give a file path in an existing folder")
    st = at.open(create=False)
    full = _resolve(st, block)
    snap = st.prefix_snapshot(full)
    doc = {"block": full, "snapshot": snap.describe(), "tokens": snap.seq_len, "bytes": snap.nbytes}
    if out_file is not None:
        try:
            doc["file"] = str(save_snapshot(snap, out_file))
        except OSError as exc:
            raise BadInputError(f"cannot write {out_file}: {exc.strerror or exc}") from None
    at.emit(doc)


def ls_cmd(at: StoreOptions = StoreOptions()) -> None:
    """List stored blocks (hash, parent, tier, tokens, bytes)."""
    from kvlab.store.inventory import list_blocks

    rows = list_blocks(at.open(create=False))
    if at.json_out:
        at.emit(rows)
        return
    columns = ("tier", "hash", "parent", "start", "tokens", "bytes")
    print_table(
        f"{len(rows)} blocks",
        columns,
        [
            (
                r["tier"],
                r["hash"][:16],
                r["parent"][:16],
                str(r["start"]),
                str(r["tokens"]),
                f"{r['bytes']:,}",
            )
            for r in rows
        ],
    )


def stats_cmd(at: StoreOptions = StoreOptions()) -> None:
    """Blocks and bytes per tier (counters are per process, so they start at zero here)."""
    at.emit(at.open(create=False).stats())


def gc_cmd(
    max_bytes: Annotated[
        str | None,
        typer.Option(
            callback=_size,
            help="Evict least recently used blocks down to this size (e.g. 2G).",
        ),
    ] = None,
    at: StoreOptions = StoreOptions(),
) -> None:
    """Remove leftovers of killed writes, evict beyond the cap, drop stale index entries."""
    at.emit(at.open(create=False, disk_bytes=max_bytes).gc())


def verify_cmd(
    repair: Annotated[bool, typer.Option("--repair", help="Move corrupt blocks to quarantine.")] = False,
    at: StoreOptions = StoreOptions(),
) -> None:
    """Check every stored block: checksum, hash chain, namespace, geometry and dtype.

    Anything else where a block belongs (a folder, FIFO, device, symbolic link, an oversized or
    malformed file) is reported without being read. Exit codes: 0 all good (or every finding
    repaired with --repair), 1 findings, 2 bad input."""
    report = at.open(create=False).verify(repair=repair)
    if at.json_out:
        at.emit(report)
    else:  # one line per tier, one line per finding
        for tier, r in report.items():
            console.print(
                f"{tier}: {r['ok']:,} good block(s), {len(r['corrupt']):,} bad, "
                f"{len(r['temp_files']):,} leftover temp file(s)",
                markup=False,
                highlight=False,
            )
            for c in r["corrupt"]:
                where = str(c.get("path") or c.get("key"))
                why = " ".join(str(c["reason"]).split())
                console.print(f"  bad {where}: {why}", markup=False, highlight=False, soft_wrap=True)
            for t in r["temp_files"]:
                console.print(f"  temp {t}", markup=False, highlight=False, soft_wrap=True)
    bad = sum(len(r["corrupt"]) for r in report.values())
    if bad and not repair:
        sys.stderr.write(
            f"kvlab store verify: {bad} bad block(s); `kvlab store verify --repair` removes them\n"
        )
        raise typer.Exit(1)
    if bad:
        sys.stderr.write(f"kvlab store verify: {bad} bad block(s) moved out of the store\n")


def generate_cmd(
    prompt: Annotated[str, typer.Argument(help="Prompt text.")],
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", min=1, help="Tokens to generate.")
    ] = 32,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt as a one-turn chat.")] = False,
    no_store: Annotated[
        bool, typer.Option("--no-store-prompt", help="Only read the store; do not add this prompt.")
    ] = False,
    at: StoreOptions = StoreOptions(),
    block_tokens: BlockOpt = 64,
    salt: SaltOpt = None,
    model: ModelOptions = ModelOptions(),
) -> None:
    """Greedy generation that loads the prompt's longest stored prefix and prefills only the rest."""
    from kvlab.store import reuse_generate

    if not prompt.strip():
        raise BadInputError("the prompt is empty")
    handle = model.load()  # before the store: a failure here creates nothing
    st = at.open(create=True, block_tokens=block_tokens)
    res = reuse_generate(handle, st, prompt, max_new_tokens, chat=chat, salt=salt, store_prompt=not no_store)
    m = res.prefill.match
    at.emit(
        {
            "text": res.text,
            "prompt_tokens": m.total_tokens,
            "cached_tokens": m.cached_tokens,
            "computed_tokens": m.to_compute,
            "tiers": m.tier_blocks,
            "ttft_ms": round(res.prefill.ttft_ms, 2),
            "lookup_ms": round(res.prefill.lookup_ms, 2),
            "store": st.describe(),
        }
    )


def experiment_cmd(redis: RedisOpt = None) -> dict:
    """Time to first token with stored prefixes (memory, disk, Redis) and non-prefix reuse quality."""
    return {"redis_url": redis}


def register(app: typer.Typer) -> None:
    store_app = typer.Typer(
        help="A tiered, content-addressed KV cache store (memory, disk, Redis).", no_args_is_help=True
    )
    app.add_typer(store_app, name="store")
    store_app.command("put")(group_command(put_cmd))
    store_app.command("get")(group_command(get_cmd))
    store_app.command("ls")(group_command(ls_cmd))
    store_app.command("stats")(group_command(stats_cmd))
    store_app.command("gc")(group_command(gc_cmd))
    store_app.command("verify")(group_command(verify_cmd))
    store_app.command("generate")(group_command(generate_cmd))
    experiment_command(store_app, "experiment", "store_reuse")(experiment_cmd)
