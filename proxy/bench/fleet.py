"""The benchmark's own model repository: the models it needs, with the scenario's parameters.

A scenario may override string parameters of its model's ``config.pbtxt`` (``accel_sim``'s
``base_ms`` and ``per_token_us`` set the emulated device). The benchmark never edits
``model_repository/`` in place: it copies the models it serves into a folder of its own and
rewrites the parameters there, so other users of the repository (tests, ``triton-proxy up``)
keep the file's defaults.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


class RepositoryError(ValueError):
    pass


def _param_re(key: str) -> re.Pattern[str]:
    return re.compile(
        r'(parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")'
        r'[^"]*(")',
        re.MULTILINE,
    )


def format_parameter(value: float | str) -> str:
    """How a number is written as a pbtxt ``string_value`` (``5.0`` -> ``5``)."""
    if isinstance(value, str):
        return value
    return f"{value:g}"


def set_parameters(config_text: str, parameters: Mapping[str, float | str]) -> str:
    """``config.pbtxt`` text with the given ``parameters`` string values replaced.

    Every key must already be a parameter of the model: a misspelt key would otherwise be
    ignored by the model and the benchmark would measure a device nobody asked for.
    """
    out = config_text
    for key, value in parameters.items():
        pattern = _param_re(key)
        if not pattern.search(out):
            known = re.findall(r'parameters\s*\{\s*key:\s*"([^"]+)"', config_text)
            raise RepositoryError(
                f"the model has no parameter {key!r}; known: {', '.join(known) or 'none'}"
            )
        text = format_parameter(value)
        if '"' in text or "\\" in text:
            raise RepositoryError(f"parameter {key!r}: value {text!r} may not contain quotes")
        out = pattern.sub(_replacement(text), out)
    return out


def _replacement(text: str) -> Callable[[re.Match[str]], str]:
    def sub(m: re.Match[str]) -> str:
        return m.group(1) + text + m.group(2)

    return sub


def bench_repository(
    source: Path,
    dest: Path,
    models: Sequence[str],
    parameters: Mapping[str, Mapping[str, float | str]] | None = None,
) -> Path:
    """Copy ``models`` from ``source`` into ``dest`` (replaced), applying ``parameters``.

    ``parameters`` maps a model name to the ``config.pbtxt`` parameters to override.
    """
    overrides = dict(parameters or {})
    unknown = sorted(set(overrides) - set(models))
    if unknown:
        raise RepositoryError(f"parameters for models not served: {', '.join(unknown)}")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for model in models:
        src = source / model
        if not (src / "config.pbtxt").is_file():
            raise RepositoryError(f"{src} is not a model folder (no config.pbtxt)")
        shutil.copytree(src, dest / model, ignore=shutil.ignore_patterns("__pycache__"))
        if model in overrides:
            cfg = dest / model / "config.pbtxt"
            try:
                cfg.write_text(set_parameters(cfg.read_text(), overrides[model]))
            except RepositoryError as exc:
                raise RepositoryError(f"{model}: {exc}") from None
    return dest
