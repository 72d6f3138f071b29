"""Bearer tokens: where a process gets its token, and how a request's token is checked.

Tokens never appear in logs or error messages; `Token.__repr__` hides the value."""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

TOKEN_ENV = "FTHSDP_TOKEN"  # noqa: S105 (a variable name, not a secret)
TOKEN_FILE_ENV = "FTHSDP_TOKEN_FILE"  # noqa: S105
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096


@dataclass(frozen=True, slots=True)
class Token:
    """A shared secret presented as `authorization: Bearer <value>`."""

    value: str = field(repr=False)

    def __post_init__(self) -> None:
        if not MIN_TOKEN_CHARS <= len(self.value) <= MAX_TOKEN_CHARS:
            raise ValueError(
                f"a token must have {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} characters, "
                f"got {len(self.value)}"
            )
        if any(c.isspace() for c in self.value):
            raise ValueError("a token must not contain whitespace")

    def header(self) -> str:
        """The value of the `authorization` header that carries this token."""
        return f"Bearer {self.value}"

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `authorization` header carries this token (constant-time compare)."""
        if not authorization or len(authorization) > MAX_TOKEN_CHARS + 16:
            return False
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.encode(), self.value.encode())


def load_token(
    value: str | None = None, path: str | None = None, env: dict[str, str] | None = None
) -> Token:
    """The token: an explicit value, else a file, else FTHSDP_TOKEN, else FTHSDP_TOKEN_FILE.

    Raises ValueError when none is set, so no service ever starts without authentication."""
    environ = os.environ if env is None else env
    if value:
        return Token(value)
    if path:
        return Token(Path(path).read_text().strip())
    if environ.get(TOKEN_ENV):
        return Token(environ[TOKEN_ENV])
    if environ.get(TOKEN_FILE_ENV):
        return Token(Path(environ[TOKEN_FILE_ENV]).read_text().strip())
    raise ValueError(
        f"no token: pass --token-file, or set {TOKEN_ENV} or {TOKEN_FILE_ENV} "
        "(every fthsdp API requires a bearer token)"
    )
