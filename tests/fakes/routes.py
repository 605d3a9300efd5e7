"""The test's own oracle of what may reach a Triton instance (issue 9, point 1).

Independent of the proxy's route table on purpose: a path the fakes recorded must be one of
the KServe v2 / Triton extension routes Triton serves, in canonical form (no empty or dot
segments, no encoded separators or dots, nothing outside ``/v2``), with a method Triton serves
it under. Model control and settings changes are allowed only when the test enabled admin.
Shared memory never reaches an instance (the proxy answers it itself).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

_SEG = r"[^/]+"
_MODEL = rf"/v2/models/{_SEG}(?:/versions/{_SEG})?"

READ_ROUTES = [
    r"/v2",
    r"/v2/health/live",
    r"/v2/health/ready",
    r"/v2/models/stats",
    _MODEL,
    _MODEL + r"/ready",
    _MODEL + r"/config",
    _MODEL + r"/stats",
    r"/v2/trace/setting",
    _MODEL + r"/trace/setting",
    r"/v2/logging",
]
INFER_ROUTES = [_MODEL + r"/infer", _MODEL + r"/generate", _MODEL + r"/generate_stream"]
ADMIN_ROUTES = [
    r"/v2/repository/index",
    rf"/v2/repository/models/{_SEG}/load",
    rf"/v2/repository/models/{_SEG}/unload",
    r"/v2/trace/setting",
    _MODEL + r"/trace/setting",
    r"/v2/logging",
]
_READ = re.compile("|".join(f"(?:{r})" for r in READ_ROUTES))
_INFER = re.compile("|".join(f"(?:{r})" for r in INFER_ROUTES))
_ADMIN = re.compile("|".join(f"(?:{r})" for r in ADMIN_ROUTES))
_ENCODED_FORBIDDEN = re.compile(r"%(2[fF]|5[cC]|2[eE]|00)")


def path_problem(method: str, raw_target: str, *, admin: bool = False) -> str | None:
    """Why a request with this method and raw target must not have reached an instance."""
    if not raw_target.startswith("/"):
        return "not origin-form (absolute-form, authority-form or asterisk)"
    path = raw_target.split("?", 1)[0]
    if path.startswith("//"):
        return "starts with '//' (a network-path reference)"
    if _ENCODED_FORBIDDEN.search(path):
        return "encoded separator, dot or NUL"
    if "\\" in path:
        return "backslash"
    segments = path.split("/")[1:]
    for seg in segments:
        if seg == "":
            return "empty segment"
        decoded = unquote(seg, errors="strict")
        if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
            return f"dot or separator segment {seg!r}"
    decoded_path = "/".join(unquote(s) for s in path.split("/"))
    if method in ("GET", "HEAD") and _READ.fullmatch(decoded_path):
        return None
    if method == "POST" and _INFER.fullmatch(decoded_path):
        return None
    if method == "POST" and admin and _ADMIN.fullmatch(decoded_path):
        return None
    return f"{method} {decoded_path} is not an allowed route" + ("" if admin else " (admin off)")
