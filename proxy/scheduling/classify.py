"""Which class a request belongs to, from its HTTP headers or gRPC metadata.

Rules, in order:

1. No API key, or one the policy does not list: the default class. Any class header is
   ignored, so an anonymous client cannot promote itself.
2. A listed key whose grant has ``allow_class_header: true`` and a class header naming a
   configured class: that class (the key is trusted to choose, e.g. a gateway that classifies
   its own traffic).
3. Otherwise the key's class; an unknown class header value is ignored.

The key comes from ``Authorization: Bearer <key>`` when ``api_key_header`` is
``authorization``, else from the named header's whole value. Keys listed as
``sha256:<hex>`` are matched by the digest of the presented key, so the policy file need not
hold the keys themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.scheduling.config import HASHED_KEY_PREFIX, ApiKeyConfig, SchedulingConfig


def header(headers: Mapping[str, str], name: str) -> str | None:
    """``headers[name]`` with the name matched case-insensitively, or None.

    HTTP headers (a ``CIMultiDictProxy``) are case-insensitive already and gRPC metadata keys
    are lower case; the scan covers plain dicts built any other way.
    """
    value = headers.get(name)
    if value is not None or isinstance(headers, CIMultiDictProxy | CIMultiDict):
        return value  # a case-insensitive mapping has answered for every spelling
    lowered = name.lower()
    for key, val in headers.items():
        if key.lower() == lowered:
            return val
    return None


class Classifier:
    """Pure: built from one config (rebuild it on reload), no state between calls."""

    def __init__(self, config: SchedulingConfig) -> None:
        self._config = config
        self._plain: dict[str, ApiKeyConfig] = {}
        self._hashed: dict[str, ApiKeyConfig] = {}
        for key, grant in config.api_keys.items():
            if key.startswith(HASHED_KEY_PREFIX):
                self._hashed[key[len(HASHED_KEY_PREFIX) :].lower()] = grant
            else:
                self._plain[key] = grant
        self._bearer = config.api_key_header.lower() == "authorization"

    def api_key(self, headers: Mapping[str, str]) -> str | None:
        """The key the request presents, or None."""
        raw = header(headers, self._config.api_key_header)
        if raw is None:
            return None
        if self._bearer:
            scheme, _, token = raw.strip().partition(" ")
            if scheme.lower() != "bearer":
                return None
            raw = token
        key = raw.strip()
        return key or None

    def grant(self, headers: Mapping[str, str]) -> ApiKeyConfig | None:
        """What the presented key is granted, or None for no key or an unknown one."""
        key = self.api_key(headers)
        if key is None:
            return None
        grant = self._plain.get(key)
        if grant is None and self._hashed:
            grant = self._hashed.get(hashlib.sha256(key.encode()).hexdigest())
        return grant

    def classify(self, headers: Mapping[str, str]) -> str:
        """The request's class name; always one of the configured classes."""
        grant = self.grant(headers)
        if grant is None:
            return self._config.default_class
        if grant.allow_class_header:
            wanted = header(headers, self._config.class_header)
            if wanted is not None and wanted.strip() in self._config.classes:
                return wanted.strip()
        return grant.class_name

    def slo_s(self, class_name: str) -> float | None:
        """The class's latency objective in seconds (``slo_p99_ms``), or None if it has none."""
        klass = self._config.classes.get(class_name)
        if klass is None or klass.slo_p99_ms is None:
            return None
        return klass.slo_p99_ms / 1000.0
