"""The pieces every colibri HTML page shares: one stylesheet, a Content-Security-Policy that
allows nothing but inline style and data: images (the page never touches the network), and
escaping helpers (every value from a file is data, never markup)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1100px;color:#222;
padding:0 1em;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd}
.sub{color:#666} table{border-collapse:collapse;margin:.6em 0;font-size:.88em}
th,td{border:1px solid #ddd;padding:.25em .55em;text-align:left} th{background:#f4f4f4}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap} td.word{white-space:nowrap} tr.changed td{background:#fff6d5}
.headline{font-size:1.1em;background:#eef6ee;border:1px solid #cde3cd;padding:.7em 1em;border-radius:6px}
.warn{font-size:1.05em;background:#fdecea;border:1px solid #f1b0ab;padding:.7em 1em;border-radius:6px}
.note{color:#666;font-size:.9em} img{max-width:100%;height:auto;display:block;margin:.6em 0}
.plots{display:flex;flex-wrap:wrap;gap:.5em;align-items:flex-start} .plots img{max-width:49%}
.scroll{overflow-x:auto} .trials td,.trials th{font-size:.74em;white-space:nowrap;padding:.2em .35em}
"""


def page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{e(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def img(path: Path | None, alt: str, missing: str = "Not drawn: the run holds no data for it.") -> str:
    if path is None or not Path(path).is_file():
        return f"<p class='note'>{e(missing)}</p>"
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f"<img alt='{e(alt)}' src='data:image/png;base64,{data}'>"


def table(headers, rows, header: bool = True) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(
            f"<td class='num'>{e(v)}</td>" if _numeric(v) else f"<td class='word'>{e(v)}</td>" if _one_word(v)
            else f"<td>{e(v)}</td>" for v in row) + "</tr>")
    return "".join(out) + "</table>"


def _one_word(v) -> bool:
    """A short value without spaces ("int4-g64", a hash): breaking it at a hyphen misreads it."""
    text = str(v)
    return 0 < len(text) <= 24 and not any(c.isspace() for c in text)


def _numeric(v) -> bool:
    if isinstance(v, (int, float)):
        return True
    try:
        float(str(v))
        return True
    except ValueError:
        return False


def e(v) -> str:
    return html.escape("-" if v is None else str(v), quote=True)
