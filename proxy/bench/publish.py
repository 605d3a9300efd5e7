"""Small copies of a benchmark's results, fit to commit (``docs/bench/``).

``python -m proxy.bench.publish bench-results/<run> docs/bench`` (or ``bench --publish DIR``)
copies the tables as they are, the JSON files without the per-repetition latency histograms
(the pooled figures, spreads, ratios and per-repetition figures stay; the histograms make a
run's ``report.json`` several megabytes) and the PNGs reduced to a 64-colour palette. The
working folder (model repository copy, server and proxy logs) is left out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DROPPED = "per-repetition latency histograms dropped (published copy); pooled figures kept"
SKIP_DIRS = {"work"}


def strip_histograms(doc: Any) -> Any:
    """The report document without ``latency_us`` under ``repetitions`` (pure, a copy)."""
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for key, value in doc.items():
            if key == "repetitions" and isinstance(value, list):
                out[key] = [_strip_all(r) for r in value]
            else:
                out[key] = strip_histograms(value)
        return out
    if isinstance(doc, list):
        return [strip_histograms(x) for x in doc]
    return doc


def _strip_all(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _strip_all(v) for k, v in doc.items() if k != "latency_us"}
    if isinstance(doc, list):
        return [_strip_all(x) for x in doc]
    return doc


def _publish_json(src: Path, dest: Path) -> None:
    doc = json.loads(src.read_text())
    small = strip_histograms(doc)
    if small != doc and isinstance(small, dict):
        small["published"] = DROPPED
    dest.write_text(json.dumps(small, separators=(",", ":"), allow_nan=False) + "\n")


def _publish_png(src: Path, dest: Path, colours: int = 64) -> None:
    try:
        from PIL import Image  # installed with matplotlib
    except ImportError:
        shutil.copyfile(src, dest)
        return
    with Image.open(src) as im:
        im.convert("RGB").quantize(colors=colours).save(dest, optimize=True)


def publish(src: Path, dest: Path) -> list[Path]:
    """Copy ``src`` (a ``--out`` folder) into ``dest``, small; returns the files written."""
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a results folder")
    written: list[Path] = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        # a work folder at any depth: several scenarios write OUT/<scenario>/work
        if not path.is_file() or SKIP_DIRS & set(rel.parts[:-1]):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            _publish_json(path, target)
        elif path.suffix == ".png":
            _publish_png(path, target)
        elif path.suffix == ".txt":
            shutil.copyfile(path, target)
        else:
            continue
        written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.publish", description=__doc__)
    p.add_argument("src", help="a bench --out folder")
    p.add_argument("dest", help="where the small copies go (e.g. docs/bench)")
    args = p.parse_args(argv)
    try:
        files = publish(Path(args.src), Path(args.dest))
    except FileNotFoundError as exc:
        print(f"publish: {exc}", file=sys.stderr)
        return 2
    total = sum(f.stat().st_size for f in files)
    print(f"published {len(files)} files, {total / 1024:.0f} KiB, into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
