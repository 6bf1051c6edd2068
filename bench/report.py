"""Rows of the benchmark table and how they are printed.

Every scenario returns a list of rows (plain dicts, written as they are to the JSON): a figure of the library
with its median and spread over ``--runs``, what it is compared with, the ratio (the median of the ratios
taken within each run, with their spread), the issue's target, and the RSS of each process.
"""

from __future__ import annotations

import statistics
from typing import Any

from .harness import Run, summary


def rate_runs(n_per_run: list[float], runs: list[Run]) -> list[float]:
    return [n / r.seconds for n, r in zip(n_per_run, runs, strict=True)]


def paired_ratio(a: list[float], b: list[float]) -> dict[str, Any]:
    """The ratio a/b taken within each run (the two shared that run's conditions), summarised."""
    return summary([x / y for x, y in zip(a, b, strict=True)])


def rss_of(runs: list[Run]) -> dict[str, float]:
    """RSS (MiB) of one process at the end of its work and its peak, medians over every process and run."""
    reports = [rep for r in runs for rep in r.reports]
    return {
        "rss_mib": statistics.median(rep["rss_kib"] for rep in reports) / 1024,
        "peak_mib": statistics.median(rep["hwm_kib"] for rep in reports) / 1024,
    }


def cpu_per_row(runs: list[Run]) -> dict[str, float | None]:
    """Client CPU (every process of the loop, getrusage) and server CPU (their own backends, and every
    PostgreSQL process on the machine) per row handled, in µs; medians over the runs."""

    def per(key: str) -> float | None:
        values = []
        for r in runs:
            total = r.total(key) if key != "server_all" else r.server_cpu_s
            rows = r.total("jobs") or 0
            if total is None or not rows:
                return None
            values.append(total / rows * 1e6)
        return statistics.median(values)

    return {
        "client_us": per("client_cpu_s"),
        "backend_us": per("backend_cpu_s"),
        "server_all_us": per("server_all"),
    }


def row(what: str, value: dict[str, Any], unit: str = "/s", **more: Any) -> dict[str, Any]:
    return {"what": what, "value": value, "unit": unit, **more}


def compared(
    what: str, values: list[float], reference: list[float], reference_name: str, target: str, **more: Any
) -> dict[str, Any]:
    """A row of ``values`` beside ``reference`` measured in the same runs: both summaries and the paired ratio."""
    from .harness import summary

    return row(what, summary(values), reference=summary(reference), reference_name=reference_name,
               ratio=paired_ratio(values, reference), target=target, **more)  # fmt: skip


def _num(v: float, unit: str) -> str:
    return f"{v:,.0f}" if unit == "/s" else f"{v:,.2f}"


def _suffix(unit: str) -> str:
    return {"/s": "/s", "×": "×", "s": " s", "ms": " ms", "%": " %"}.get(unit, unit)


def fmt_summary(s: dict[str, Any] | float | None, unit: str) -> str:
    """``median unit (min–max)``, or one figure when there is no spread."""
    if s is None:
        return ""
    if not isinstance(s, dict):
        return f"{_num(float(s), unit)}{_suffix(unit)}"
    text = f"{_num(s['median'], unit)}{_suffix(unit)}"
    if len(s.get("runs", [])) > 1:
        text += f" ({_num(s['min'], unit)}–{_num(s['max'], unit)})"
    return text


def render_rows(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        ref = ""
        if r.get("reference") is not None:
            ref = f"{r['reference_name']}: {fmt_summary(r['reference'], r.get('reference_unit', r['unit']))}"
        elif r.get("reference_name"):
            ref = r["reference_name"]
        if r.get("reference_note"):
            ref += f" — {r['reference_note']}"
        ratio = fmt_summary(r.get("ratio"), "×") if r.get("ratio") is not None else ""
        rss = f"{r['rss']['rss_mib']:.1f} MiB" if r.get("rss") else ""
        lines.append(
            f"| {r['what']} | {fmt_summary(r['value'], r['unit'])} | {ref} | {ratio} | {r.get('target', '')} | {rss} |"
        )
    return lines


HEADER = [
    "| scenario | library: median (min–max) | compared with | ratio: median (min–max) | target | RSS / process |",
    "|---|---|---|---|---|---|",
]


def render(results: dict[str, Any]) -> str:
    lines = list(HEADER)
    for name, rows in results["scenarios"].items():
        if isinstance(rows, list):
            lines += render_rows(rows)
        else:
            lines.append(f"| {name} | see the JSON | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.report [results.json]``: print the table of a saved run again."""
    import json
    import sys
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else Path(__file__).resolve().parent / "results" / "latest.json")
    results = json.loads(path.read_text())
    print(render(results))
    print("\n" + "\n".join(f"- {note}" for note in results.get("notes", [])))
    machine = results.get("machine", {})
    print(f"\n{results.get('runs')} run(s); {machine.get('cpus')} CPUs; PostgreSQL {machine.get('postgresql')}; "
          f"Python {machine.get('python')}; command: {results.get('command')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
