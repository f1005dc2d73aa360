"""Secrets out of what a run prints and saves: the config dump, the console, the trackers' config.

Two rules, applied to a plain (resolved) config container: a value under a key that names a secret
(`api_key`, `token`, `secret`, `password`, `credential`, alone or as the last `_` part, e.g.
`hf_token`; not `tokenizer` or `max_token_len`) is replaced by `***`; and any string that contains
the value of a secret environment variable (a name with the same words, e.g. `WANDB_API_KEY`,
`HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`) has it replaced by `***` — a secret interpolated into the
config from the environment (`${oc.env:WANDB_API_KEY}`) is caught by its value.
"""

from __future__ import annotations

import os
import re

MASK = "***"
_SECRET_NAME = re.compile(r"(^|_)(api_?key|token|secret|password|passwd|credentials?)$", re.IGNORECASE)
_SECRET_ENV = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)", re.IGNORECASE)
_MIN_SECRET_LEN = 8  # shorter env values (e.g. "1", "true") would mask ordinary text


def secret_env_values(environ=None) -> list[str]:
    """Values of environment variables whose names say they hold a secret, longest first."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if _SECRET_ENV.search(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact(value, environ=None, _secrets=None):
    """A copy of a config container with secrets replaced by `***` (see the module docstring)."""
    secrets = secret_env_values(environ) if _secrets is None else _secrets
    if isinstance(value, dict):
        return {k: MASK if _secret_key(k, v) else redact(v, environ, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, environ, secrets) for v in value)
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, MASK)
    return value


def _secret_key(name, value) -> bool:
    return isinstance(name, str) and bool(_SECRET_NAME.search(name)) and value not in (None, "")
