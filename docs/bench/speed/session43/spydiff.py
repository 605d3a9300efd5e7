"""Compare two py-spy ``--format raw`` profiles: samples per function, inclusive, b minus a.

Usage: python spydiff.py A.txt B.txt (session 43: a = least_requests + classes, b = the class
default, mixed.yaml x1).
"""

import collections
import sys
from pathlib import Path


def load(path: str) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Self and inclusive samples per frame of a raw profile ("frame;frame;... count")."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n, frames = int(count), stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return own, inclusive


def main() -> None:
    a_own, a_incl = load(sys.argv[1])
    b_own, b_incl = load(sys.argv[2])
    print("total", sum(a_own.values()), sum(b_own.values()))
    print("-- inclusive diff (b - a), top 50")
    diff = collections.Counter({k: b_incl[k] - a_incl[k] for k in set(a_incl) | set(b_incl)})
    for frame, n in diff.most_common(50):
        print(f"{n:5d} a={a_incl[frame]:4d} b={b_incl[frame]:4d} {frame[:140]}")


if __name__ == "__main__":
    main()
