"""Text for the group page: escaped HTML and numbers as the page shows them."""

from __future__ import annotations

import html
import math


def _fmt(value: float | None) -> str:
    """3 significant digits, thousands separators from 1,000 on; blank for None."""
    if value is None or math.isinf(value):
        return "" if value is None else str(value)
    a = abs(value)
    if a == 0 or 1e-3 <= a < 999.5:
        return f"{value:.3g}"
    return f"{value:,.0f}" if a >= 999.5 else f"{value:.2e}"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)
