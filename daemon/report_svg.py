"""Charts as inline SVG, built by hand: no plotting library, no script, nothing fetched.

`chart` draws nights along x (bars grouped per night, lines over them, a gap where a value is
missing); `curve` draws a numeric x (the loss per step). Every chart is a <figure class="chart">
holding one <svg class="plot">; bars are <rect class="bar">, lines <path class="line">, points
<circle class="point"> (what the report's test looks for in the rendered page).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

W, H = 560, 250  # viewBox; the page scales it to the column's width
LEFT, RIGHT, TOP, BOTTOM = 58, 16, 34, 46  # margins: y labels, legend, x labels
PALETTE = ["#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#64748b"]
PASS, FAIL = "#16a34a", "#dc2626"


@dataclass
class Series:
    name: str
    values: Sequence[float | None]
    kind: str = "line"  # line | bar
    color: str | None = None
    dashed: bool = False
    point_colors: Sequence[str | None] | None = None  # per night: e.g. the gate's decision
    extra: dict[str, str] = field(default_factory=dict)


def nice_ticks(top: float, n: int = 4, bottom: float = 0.0) -> list[float]:
    """Ticks from `bottom` (rounded down) to `top` (rounded up) with a 1-2-2.5-5 step."""
    if not (math.isfinite(top) and math.isfinite(bottom)) or top <= bottom:
        return [bottom, bottom + 1.0] if math.isfinite(bottom) else [0.0, 1.0]
    raw = (top - bottom) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(bottom / step + 1e-9)
    return [round((first + i) * step, 12) for i in range(math.ceil(top / step - 1e-9) - first + 1)]


def fmt(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g} M"
    if a >= 1e4:
        return f"{v / 1e3:.3g} k"
    if a >= 100 or v == int(v):
        return f"{v:,.0f}"
    return f"{v:.3g}"


def tick_label(t: float, ticks: list[float]) -> str:
    """As many decimals as the step needs (7.625, 7.65, 7.675 stay apart)."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    if max(abs(ticks[0]), abs(ticks[-1])) >= 1e4 or step >= 1:
        return fmt(t)
    decimals = 0
    while decimals < 6 and abs(round(step, decimals) - step) > step * 1e-6:
        decimals += 1
    return f"{t:.{decimals}f}"


def _frame(title: str, unit: str, ticks: list[float], y: Callable[[float], float], legend: list[tuple[str, str, bool]],
           ident: str) -> list[str]:
    out = [f'<svg class="plot" id="{ident}" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(title)}" '
           f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>']
    for t in ticks:
        yy = y(t)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}"/>')
        out.append(f'<text class="tick" x="{LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">'
                   f'{escape(tick_label(t, ticks))}</text>')
    if unit:
        out.append(f'<text class="unit" x="6" y="{TOP - 12}">{escape(unit)}</text>')
    x = LEFT
    for name, color, dashed in legend:
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        out.append(f'<line x1="{x}" x2="{x + 16}" y1="{TOP - 16}" y2="{TOP - 16}" stroke="{color}" '
                   f'stroke-width="6"{dash}/>')
        out.append(f'<text class="legend" x="{x + 21}" y="{TOP - 12}">{escape(name)}</text>')
        x += 30 + 6.4 * len(name)
    return out


def _empty(title: str, ident: str, why: str) -> str:
    return (f'<svg class="plot empty" id="{ident}" viewBox="0 0 {W} {H // 2}" role="img" aria-label="{escape(title)}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
            f'<text class="none" x="{W / 2}" y="{H / 4}" text-anchor="middle">{escape(why)}</text></svg>')


def figure(title: str, svg: str, caption: str = "") -> str:
    cap = f"<figcaption>{escape(caption)}</figcaption>" if caption else ""
    return f'<figure class="chart"><h3>{escape(title)}</h3>{svg}{cap}</figure>'


def chart(title: str, labels: Sequence[str], series: Sequence[Series], *, unit: str = "", ident: str,
          caption: str = "", empty: str = "nothing measured yet") -> str:
    series = [s for s in series if any(v is not None for v in s.values)]  # unmeasured: not even in the legend
    values = [v for s in series for v in s.values if v is not None]
    if not labels or not values:
        return figure(title, _empty(title, ident, empty), caption)
    if any(s.kind == "bar" for s in series) or min(values) <= 0:
        ticks = nice_ticks(max(max(values), 0.0), bottom=min(0.0, min(values)))  # bars start at 0
    else:  # lines alone: the range of the data (a loss moving from 7.62 to 7.58 must show)
        pad = (max(values) - min(values)) * 0.15 or abs(max(values)) * 0.05 or 1.0
        ticks = nice_ticks(max(values) + pad, bottom=max(0.0, min(values) - pad))
    lo, hi = ticks[0], ticks[-1]
    span = (hi - lo) or 1.0
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    slot = plot_w / len(labels)

    def y(v: float) -> float:
        return TOP + plot_h * (1 - (v - lo) / span)

    def cx(i: int) -> float:
        return LEFT + slot * (i + 0.5)

    colors = [s.color or PALETTE[k % len(PALETTE)] for k, s in enumerate(series)]
    out = _frame(title, unit, ticks, y, [(s.name, c, s.dashed) for s, c in zip(series, colors, strict=True)], ident)
    bars = [k for k, s in enumerate(series) if s.kind == "bar"]
    bw = min(28.0, slot * 0.8 / max(1, len(bars)))
    for j, k in enumerate(bars):
        s = series[k]
        for i, v in enumerate(s.values):
            if v is None:
                continue
            x0 = cx(i) - bw * len(bars) / 2 + j * bw
            top, base = y(max(v, 0.0)), y(min(v, 0.0))  # bars are 0-based (lo <= 0 then)
            out.append(f'<rect class="bar" x="{x0:.1f}" y="{top:.1f}" width="{bw - 2:.1f}" height="{base - top:.1f}" '
                       f'fill="{colors[k]}"><title>{escape(f"{s.name}, {labels[i]}: {fmt(v)}")}</title></rect>')
    for k, s in enumerate(series):
        if s.kind != "line":
            continue
        d, pen = [], "M"
        for i, v in enumerate(s.values):
            if v is None:
                pen = "M"
                continue
            d.append(f"{pen}{cx(i):.1f},{y(v):.1f}")
            pen = "L"
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        if len(d) > 1:
            out.append(f'<path class="line" d="{" ".join(d)}" stroke="{colors[k]}" fill="none" '
                       f'stroke-width="2"{dash}/>')
        for i, v in enumerate(s.values):
            if v is None:
                continue
            fill = (s.point_colors[i] if s.point_colors else None) or colors[k]
            out.append(f'<circle class="point" cx="{cx(i):.1f}" cy="{y(v):.1f}" r="4" fill="{fill}" '
                       f'stroke="{colors[k]}"><title>{escape(f"{s.name}, {labels[i]}: {fmt(v)}")}</title></circle>')
    every = max(1, math.ceil(len(labels) / 10))
    for i, lab in enumerate(labels):
        if i % every == 0:
            out.append(f'<text class="xlabel" x="{cx(i):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">'
                       f'{escape(lab)}</text>')
    out.append(f'<line class="axis" x1="{LEFT}" x2="{W - RIGHT}" y1="{y(lo):.1f}" y2="{y(lo):.1f}"/></svg>')
    return figure(title, "".join(out), caption)


def curve(title: str, points: Sequence[tuple[float, float]], *, unit: str = "", ident: str, caption: str = "",
          empty: str = "not recorded") -> str:
    """y over a numeric x (training step)."""
    if len(points) < 1:
        return figure(title, _empty(title, ident, empty), caption)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ticks = nice_ticks(max(ys), bottom=min(0.0, min(ys)))
    x0, x1 = min(xs), max(xs)
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM

    def y(v: float) -> float:
        return TOP + plot_h * (1 - (v - ticks[0]) / ((ticks[-1] - ticks[0]) or 1.0))

    def x(v: float) -> float:
        return LEFT + plot_w * ((v - x0) / (x1 - x0) if x1 > x0 else 0.5)

    out = _frame(title, unit, ticks, y, [("loss per step", PALETTE[0], False)], ident)
    d = " ".join(f"{'M' if i == 0 else 'L'}{x(a):.1f},{y(b):.1f}" for i, (a, b) in enumerate(points))
    out.append(f'<path class="line" d="{d}" stroke="{PALETTE[0]}" fill="none" stroke-width="1.5"/>')
    if len(points) == 1:
        out.append(f'<circle class="point" cx="{x(xs[0]):.1f}" cy="{y(ys[0]):.1f}" r="4" fill="{PALETTE[0]}"/>')
    for t in nice_ticks(x1 - x0 if x1 > x0 else 1.0, 5):
        if x0 + t <= x1 or x1 == x0:
            out.append(f'<text class="xlabel" x="{x(x0 + t):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">'
                       f'{escape(fmt(x0 + t))}</text>')
    out.append(f'<text class="xlabel" x="{W - RIGHT}" y="{H - 6}" text-anchor="end">step</text>')
    out.append(f'<line class="axis" x1="{LEFT}" x2="{W - RIGHT}" y1="{y(ticks[0]):.1f}" y2="{y(ticks[0]):.1f}"/>'
               '</svg>')
    return figure(title, "".join(out), caption)
