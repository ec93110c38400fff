"""Saying a quiet eager run once: a WARNING the first time each cause happens.

Falling back to eager is fine; doing it silently is the bug. Every layer counts its
eager runs per cause (``stats()``) and logs the first of each cause at WARNING, so a
log shows that graphs stopped being used and why, without a line per call.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["WarnOnce"]


class WarnOnce:
    """Remembers which causes one object has already warned about."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._said: set[str] = set()

    def __call__(self, cause: str, message: str, *args: Any) -> bool:
        """Log ``message % args`` at WARNING if ``cause`` was not said before; return
        whether it was logged now."""
        if cause in self._said:
            return False
        self._said.add(cause)
        self._logger.warning(message, *args)
        return True

    def said(self, cause: str) -> bool:
        return cause in self._said
