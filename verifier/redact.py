"""Secrets out of logs and answers: URLs cut to scheme://host[:port], and a logging filter that blanks known
secrets (an RPC URL's path and query, keys) in every record, whoever logged it (web3, requests, urllib3, us)."""

import logging
from urllib.parse import urlsplit

HIDDEN = '[redacted]'


def redact_url(url):
    """scheme://host[:port] of a URL, without user info, path, query or fragment (a provider's key is often there)."""
    try:
        parts = urlsplit(str(url or ''))
        host = parts.hostname or ''
        port = parts.port
    except ValueError:
        return HIDDEN
    if not parts.scheme or not host:
        return HIDDEN if url else ''
    host = f'[{host}]' if ':' in host else host
    return f'{parts.scheme}://{host}' + (f':{port}' if port is not None else '')


def url_secrets(url):
    """The parts of a URL that may carry a key: the whole URL, its user info, path and query (the texts a library
    may write into a message)."""
    if not url:
        return []
    parts = urlsplit(str(url))
    found = [str(url)]
    if parts.username or parts.password:
        found.append(parts.netloc.rsplit('@', 1)[0])
    if parts.path not in ('', '/'):
        found.append(parts.path + ('?' + parts.query if parts.query else ''))
        found.append(parts.path)
    if parts.query:
        found.append(parts.query)
    return found


def without_secrets(text, secrets):
    """`text` with every one of `secrets` (longest first) replaced by [redacted]."""
    for secret in sorted((s for s in secrets if s and len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text


class SecretFilter(logging.Filter):
    """A handler's filter that blanks the given secrets in each record's message and traceback."""

    def __init__(self, secrets=()):
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def add(self, *secrets):
        self.secrets.extend(s for s in secrets if s)

    def filter(self, record):
        if not self.secrets:
            return True
        message = record.getMessage()
        record.msg, record.args = without_secrets(message, self.secrets), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = without_secrets(record.exc_text, self.secrets)
        if record.stack_info:
            record.stack_info = without_secrets(record.stack_info, self.secrets)
        return True
