"""`nightshift report`: one self-contained HTML page of the last nights.

No script, no external stylesheet, image or font: the CSS is inline and the plots are inline SVG
(daemon/report_svg.py), so the file can be mailed, archived or opened offline.

A config of several adapters (issue 43) gets an overview table and then one section per adapter, each
with its own charts, loss curve and table of nights (chart ids carry the section's prefix, so they stay
unique on the page); a config of one adapter gets the page it always did.
"""

from __future__ import annotations

import re
from datetime import datetime
from html import escape
from typing import Any

from daemon.report_data import AdapterReport, NightRow, Report
from daemon.report_svg import FAIL, PASS, Series, chart, curve, fmt

CSS = """
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; background: #f8fafc;
       color: #0f172a; }
header { background: #0f172a; color: #f8fafc; padding: 18px 28px; }
header h1 { margin: 0 0 4px; font-size: 22px; }
header p { margin: 0; color: #cbd5e1; font-size: 13px; }
main { padding: 12px 28px 40px; max-width: 1280px; }
h2 { font-size: 17px; margin: 26px 0 8px; border-bottom: 1px solid #e2e8f0; padding-bottom: 4px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 14px; }
figure.chart { margin: 0; background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 8px 10px; }
figure.chart h3 { margin: 0 0 2px; font-size: 14px; }
figcaption { font-size: 12px; color: #475569; margin-top: 2px; }
svg.plot { width: 100%; height: auto; display: block; }
svg.plot text { font-size: 11px; fill: #334155; }
svg.plot text.none { font-size: 14px; fill: #94a3b8; }
svg.plot line.grid { stroke: #e2e8f0; }
svg.plot line.axis { stroke: #94a3b8; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 14px 0 4px; }
.card { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 8px 14px; min-width: 130px; }
.card b { display: block; font-size: 18px; }
.card span { font-size: 12px; color: #475569; }
table { border-collapse: collapse; font-size: 12px; background: #fff; width: 100%; }
th, td { border: 1px solid #e2e8f0; padding: 4px 6px; text-align: right; white-space: nowrap; }
th { background: #f1f5f9; }
td.l, th.l { text-align: left; }
.succeeded, .pass { color: #15803d; font-weight: 600; }
.rejected, .failed, .fail { color: #b91c1c; font-weight: 600; }
.skipped, .interrupted { color: #a16207; }
.scroll { overflow-x: auto; }
section.adapter { margin-top: 30px; padding-top: 2px; border-top: 3px solid #0f172a; }
section.adapter > h2 { border-bottom: none; font-size: 19px; }
h3.section { font-size: 15px; margin: 20px 0 8px; color: #334155; }
"""


def labels(nights: list[NightRow]) -> list[str]:
    """The night's date (11-21); with the start time where a date has several runs (manual nights)."""
    short = [n.night.removeprefix("manual-")[5:] or n.night for n in nights]
    return [f"{s} {datetime.fromtimestamp(n.started_at).astimezone():%H:%M}" if short.count(s) > 1 and n.started_at
            else s for s, n in zip(short, nights, strict=True)]


def _col(nights: list[NightRow], attr: str, scale: float = 1.0) -> list[float | None]:
    return [None if getattr(n, attr) is None else getattr(n, attr) * scale for n in nights]


def _gate_colors(nights: list[NightRow]) -> list[str | None]:
    return [PASS if n.outcome == "succeeded" else FAIL if n.outcome == "rejected" else None for n in nights]


def _metric_names(nights: list[NightRow]) -> tuple[list[str], list[str]]:
    """(data sets, metric names) measured in any night: heldout/regression, loss/accuracy/..."""
    data, names = [], []
    for n in nights:
        for key, m in n.metrics.items():
            d = key.rsplit("_", 1)[0]
            if d not in data:
                data.append(d)
            for k in m or {}:
                if k not in names:
                    names.append(k)
    return data, names


def quality_charts(nights: list[NightRow], labels: list[str], prefix: str = "") -> list[str]:
    data, names = _metric_names(nights)
    if not names:  # older summaries: the losses alone
        data, names = ["heldout", "regression"], ["loss"]
    out = []
    gate = _gate_colors(nights)
    for name in names:
        series = []
        for k, d in enumerate(data):
            for when in ("before", "after"):
                vals = [((n.metrics.get(f"{d}_{when}") or {}).get(name) if n.metrics
                         else n.losses.get(f"{d}_{when}") if name == "loss" else None) for n in nights]
                series.append(Series(f"{d} {when}", vals, color=["#2563eb", "#f59e0b", "#10b981", "#8b5cf6"][k % 4],
                                     dashed=when == "before", point_colors=gate if when == "after" else None))
        out.append(chart(f"{name}: before and after each night", labels, series,
                         ident=f"{prefix}chart-quality-{name}",
                         caption="dashed: the adapter in service before the night; solid: the candidate. "
                                 "Points after: green promoted, red rejected by the gate."))
    kl = [n.kl_from_service for n in nights]
    out.append(chart("forgetting: KL of the candidate from the adapter in service", labels,
                     [Series("KL on tonight's samples", kl, point_colors=gate)], unit="nats/token",
                     ident=f"{prefix}chart-forgetting-kl",
                     caption="how far each night's candidate moved from the version "
                     "in service on tonight's data: it predicts forgetting (canary exact match: the quality charts)"))
    return out


def cards(r: AdapterReport) -> str:
    if not r.nights:
        return ""
    last = r.nights[-1]
    items = [
        ("last night", f'<span class="{escape(last.outcome)}">{escape(last.outcome)}</span>'),
        ("in service after it", escape(last.version_name or "—") + ("" if last.promoted else " (not promoted)")
         if last.version_name else "—"),
        ("trained", f"{last.trained_samples:,} samples"),
        ("backlog", f"{last.backlog_samples:,} samples" if last.backlog_samples is not None else "—"),
        ("throughput", f"{fmt(last.tokens_per_second)} tok/s" if last.tokens_per_second else "—"),
        ("per million tokens", " · ".join(x for x in (
            f"{last.joules_per_1k_tokens:,.1f} kJ" if last.joules_per_1k_tokens is not None else "",
            f"${last.dollars_per_million_tokens:,.3f}" if last.dollars_per_million_tokens is not None else "") if x)
         or "—"),
    ]
    return '<div class="cards">' + "".join(f'<div class="card"><b>{v}</b><span>{escape(k)}</span></div>'
                                           for k, v in items) + "</div>"


def outcome_text(n: NightRow) -> str:
    """The outcome, and how the night got there when it took more than one process (issue 42: an interrupted and
    resumed night showed as one plain "succeeded")."""
    if n.attempts <= 1 and not n.interruptions and not n.failed_attempts:
        return n.outcome
    how = [f"{k} {label}" for k, label in ((n.interruptions, "interrupted"), (n.failed_attempts, "crashed")) if k]
    return f"{n.outcome} after {n.attempts} attempts ({', '.join([*how, 'resumed'])})"


def gate_text(n: NightRow) -> str | None:
    """pass / fail, with the checks that failed (their figures and rule) or why a passed one was held back."""
    if n.gate is None:
        return None
    if n.gate.passed:
        return "pass" + (f": {n.gate.held_back}" if n.gate.held_back else "")
    failed = [c for c in n.gate.checks if not c.get("passed", True)]
    why = "; ".join(f"{c.get('name')} {fmt(c['before'])} -> {fmt(c['after'])} ({c.get('rule')})"
                    if c.get("before") is not None and c.get("after") is not None
                    else f"{c.get('name')}: {c.get('skipped') or c.get('rule')}" for c in failed)
    return "fail" + (f": {why}" if why else "")


def table(nights: list[NightRow]) -> str:
    cols: list[tuple[str, Any]] = [
        ("night", lambda n: n.night), ("outcome", outcome_text), ("version", lambda n: n.version_name),
        ("trained", lambda n: n.trained_samples), ("deferred", lambda n: n.deferred_samples),
        ("backlog", lambda n: n.backlog_samples), ("tok/s", lambda n: n.tokens_per_second),
        ("train s (pred / actual)", lambda n: f"{fmt(n.predicted_train_seconds or 0)} / "
                                                f"{fmt(n.actual_train_seconds or 0)}"),
        ("KL", lambda n: n.kl_from_service),
        ("gate", gate_text),
        ("error", lambda n: "; ".join([*([n.error] if n.error else []), *(f"hot-swap: {t} did not take it"
                                                                           for t in n.hotswap_failed)]) or None),
    ]
    head = "".join(f'<th class="l">{escape(c)}</th>' if i < 3 else f"<th>{escape(c)}</th>"
                   for i, (c, _) in enumerate(cols))
    body = []
    for n in reversed(nights):
        cells = []
        for i, (c, get) in enumerate(cols):
            v = get(n)
            text = "—" if v is None else fmt(v) if isinstance(v, int | float) and not isinstance(v, bool) else str(v)
            cls = f' class="l {escape(n.outcome)}"' if c == "outcome" else \
                ' class="l"' if i < 3 or c in ("error", "gate") else ""
            cells.append(f"<td{cls}>{escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>'


def sections(r: AdapterReport, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(title, charts) of one adapter's nights; `prefix` keeps chart ids unique where a page has several."""
    n, labs = r.nights, labels(r.nights)
    gb = 1 / 1e9
    return [
        ("Data", [
            chart("Samples per night", labs, [
                Series("trained", [float(x.trained_samples) for x in n], kind="bar", color="#2563eb"),
                Series("deferred", _col(n, "deferred_samples"), kind="bar", color="#f59e0b"),
                Series("backlog after", _col(n, "backlog_samples"), color="#ef4444")], ident=f"{prefix}chart-data",
                caption="deferred: pending samples that did not fit the night; backlog: pending after it"),
        ]),
        ("Throughput", [
            chart("Tokens per second", labs, [Series("tok/s", _col(n, "tokens_per_second"))],
                  ident=f"{prefix}chart-tps"),
            chart("Samples per hour", labs, [Series("samples/h", _col(n, "samples_per_hour"), color="#10b981")],
                  ident=f"{prefix}chart-sph"),
        ]),
        ("Budget", [
            chart("Training time: predicted vs actual", labs, [
                Series("predicted", _col(n, "predicted_train_seconds"), kind="bar", color="#94a3b8"),
                Series("actual", _col(n, "actual_train_seconds"), kind="bar", color="#2563eb")], unit="seconds",
                ident=f"{prefix}chart-seconds"),
            chart("Tokens: planned vs trained", labs, [
                Series("planned", _col(n, "planned_tokens"), kind="bar", color="#94a3b8"),
                Series("trained", [float(x.trained_tokens) for x in n], kind="bar", color="#2563eb")],
                unit="tokens", ident=f"{prefix}chart-tokens",
                caption="planned: the night's recorded plan (tokens x epochs where it did not record the total)"),
        ]),
        ("Quality and the gate", quality_charts(n, labs, prefix)),
        ("Energy and memory", [
            chart("Energy per version", labs, [Series("kJ", _col(n, "energy_joules", 1e-3), kind="bar",
                                                        color="#8b5cf6")], unit="kJ", ident=f"{prefix}chart-energy",
                  empty="not measured (no NVIDIA GPU)"),
            chart("Joules per 1k tokens", labs, [Series("J / 1k tokens", _col(n, "joules_per_1k_tokens"),
                                                          color="#8b5cf6")], ident=f"{prefix}chart-jpt",
                  empty="not measured (no NVIDIA GPU)"),
            chart("Peak GPU memory (reserved)", labs, [
                Series("peak", _col(n, "vram_peak_bytes", gb), kind="bar", color="#0ea5e9"),
                Series("card", _col(n, "vram_total_bytes", gb), color="#64748b", dashed=True)], unit="GB",
                ident=f"{prefix}chart-vram", empty="not measured (no NVIDIA GPU)"),
        ]),
        ("The last night's loss curve", [
            curve(f"Training loss per step{f' ({r.loss_curve_version})' if r.loss_curve_version else ''}",
                  [(p.step, p.loss) for p in r.loss_curve or []], ident=f"{prefix}chart-loss-curve",
                  empty="not recorded"),
        ]),
    ]


def adapter_body(r: AdapterReport, prefix: str = "", tag: str = "h2") -> str:
    """Cards, the charts by section and the table of nights of one ledger."""
    if not r.nights:
        return "<p>No finished night yet: run <code>nightshift once</code> or start the service.</p>"
    attr = ' class="section"' if tag != "h2" else ""
    parts = [f"<{tag}{attr}>{escape(title)}</{tag}><div class=\"grid\">{''.join(figs)}</div>"
             for title, figs in sections(r, prefix)]
    return cards(r) + "".join(parts) + f"<{tag}{attr}>Nights</{tag}>" + table(r.nights)


def anchor(i: int, name: str) -> str:
    return f"a{i}-" + re.sub(r"[^A-Za-z0-9_-]", "-", name)


def overview(adapters: list[AdapterReport]) -> str:
    """One row per adapter: its last night at a glance, a link to its section."""
    rows = []
    for i, a in enumerate(adapters):
        last = a.nights[-1] if a.nights else None
        version = "—" if last is None or not last.version_name else \
            last.version_name + ("" if last.promoted else " (not promoted)")
        cells = [f'<td class="l"><a href="#{anchor(i, a.adapter)}">{escape(a.adapter)}</a></td>',
                 f'<td class="l">{escape(last.night if last else "—")}</td>',
                 f'<td class="l {escape(last.outcome) if last else ""}">{escape(outcome_text(last) if last else "—")}'
                 "</td>", f'<td class="l">{escape(version)}</td>',
                 f"<td>{fmt(last.trained_samples) if last else '—'}</td>",
                 f"<td>{fmt(last.backlog_samples) if last and last.backlog_samples is not None else '—'}</td>",
                 f"<td>{len(a.nights)}</td>"]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f'<th class="l">{c}</th>' for c in ("adapter", "last night", "outcome", "version")) + \
        "<th>trained</th><th>backlog</th><th>nights</th>"
    return f'<div class="scroll"><table class="adapters"><tr>{head}</tr>{"".join(rows)}</table></div>'


def render(r: Report) -> str:
    generated = datetime.fromtimestamp(r.generated_at).astimezone().strftime("%Y-%m-%d %H:%M %Z")
    if r.adapters:
        title = f"nightshift: {len(r.adapters)} adapters, {r.night_count()} night(s)"
        body = "<h2>Adapters</h2>" + overview(r.adapters) + "".join(
            f'<section class="adapter" id="{anchor(i, a.adapter)}"><h2>Adapter {escape(a.adapter)}</h2>'
            f"{adapter_body(a, anchor(i, a.adapter) + '-', 'h3')}</section>" for i, a in enumerate(r.adapters))
    else:
        title, body = f"nightshift: the last {len(r.nights)} night(s)", adapter_body(r)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<style>{CSS}</style></head>
<body><header><h1>{escape(title)}</h1>
<p>state directory {escape(r.state_dir)} · generated {escape(generated)}</p></header>
<main>{body}</main></body></html>
"""
