"""The rule for API and admin keys, read once at start-up (no torch, no server imports).

Clients send keys in an HTTP header, which servers decode as Latin-1 while kvlab compares keys as UTF-8
bytes: a key with a character outside printable ASCII could be accepted at start yet never match, an
outage with no message. So a key is 8 or more printable ASCII characters without spaces (``!`` to ``~``),
and the admin key differs from every tenant's.
"""

from __future__ import annotations

from kvlab.errors import BadInputError

MIN_KEY_CHARS = 8


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot be a key, or None."""
    if len(key) < MIN_KEY_CHARS:
        return f"needs at least {MIN_KEY_CHARS} characters"
    odd = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if odd is not None:
        what = "a space" if key[odd].isspace() else f"{key[odd]!a}, not printable ASCII"
        return f"has {what} at character {odd + 1} (keys are printable ASCII without spaces)"
    return None


def check_keys(api_keys: tuple[str, ...], admin_key: str | None) -> None:
    """Refuse, in one line that never quotes a key, any key :func:`key_problem` rejects, and an admin key
    that is also a tenant's key."""
    named = [(f"API key {i + 1} of {len(api_keys)}", key) for i, key in enumerate(api_keys)]
    for name, key in named + ([("the admin key", admin_key)] if admin_key is not None else []):
        why = key_problem(key)
        if why is not None:
            raise BadInputError(f"{name} {why}")
    if admin_key is not None and admin_key in api_keys:
        raise BadInputError("the admin key must differ from every API key")
