"""A byte budget for request bodies the proxy holds in memory (queued or in flight).

Every body read from a client is held against one budget until its request ends; a request
whose body does not fit is refused with 429 / RESOURCE_EXHAUSTED and ``Retry-After``, before
the rest of it is read where the size is known up front. Holds are release-once tokens, like
``fleet.track``: every exit path returns the bytes exactly once.
"""

from __future__ import annotations

from types import TracebackType

from proxy.errors import Code, ProxyError

RETRY_AFTER_S = 1.0


class Hold:
    """Bytes held against a :class:`ByteBudget`; :meth:`release` returns them once."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: ByteBudget) -> None:
        self._budget: ByteBudget | None = budget
        self.nbytes = 0

    def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` more; raises :class:`ProxyError` (429) when they do not fit."""
        budget = self._budget
        if budget is None:
            raise RuntimeError("hold already released")
        budget._take(nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.in_use -= self.nbytes

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.refused = 0

    def hold(self, nbytes: int = 0) -> Hold:
        """A hold of ``nbytes`` (grow it as more arrives); 429 when they do not fit."""
        h = Hold(self)
        if nbytes:
            h.grow(nbytes)
        return h

    def _take(self, nbytes: int) -> None:
        if self.in_use + nbytes > self.limit:
            self.refused += 1
            raise ProxyError(
                Code.RESOURCE_EXHAUSTED,
                f"triton-proxy is holding {self.in_use} bytes of request bodies and this "
                f"request needs {nbytes} more, over its budget of {self.limit} bytes "
                f"(limits.max_buffered_bytes); retry after {RETRY_AFTER_S:g} s",
                retry_after_s=RETRY_AFTER_S,
            )
        self.in_use += nbytes
