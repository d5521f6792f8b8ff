"""The daemon's logging: plain text or one JSON object a line (``--log-format json``), stdlib only.

Secrets never reach a log line: every record passes :class:`RedactSecrets`, which replaces bearer
tokens (``Bearer <token>``, ``authorization: <value>``) and PEM private key blocks by ``<redacted>``,
whatever logged them (kvtier, grpc, a library's exception text).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_SECRETS = [
    (re.compile(r"(?i)(bearer\s+)[^\s'\",;]+"), r"\1<redacted>"),
    (re.compile(r"(?i)(authorization['\"]?\s*[:=,]\s*['\"]?)(?!bearer\s)[^\s'\",;)]+"), r"\1<redacted>"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|$)", re.S), "<redacted key>"),
]


def redact(text: str) -> str:
    """``text`` with bearer tokens, authorization values and private keys replaced."""
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text


class RedactSecrets(logging.Filter):
    """Rewrites each record's message (arguments merged) and exception text without secrets."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, ``thread``,
    and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "thread": record.threadName,
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text") -> logging.Handler:
    """Log to stderr at ``level`` as ``text`` or ``json``, secrets redacted; replaces the root handlers.

    Raises:
        ValueError: an unknown format.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RedactSecrets())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
