#!/usr/bin/env python3
"""Render a colibri report.html (or compare.html) with headless Chromium: a PNG of the whole
page, and a load check (every image decoded, no error, no console error, no CSP violation).

    scripts/render_report.py reports/tune-demo-.../report.html -o /tmp/report.png
    scripts/render_report.py page.html --check-only

Exit status 0 when the page loads cleanly, 1 when it does not (the problems are listed), 2 on
bad input (no such file, no chromium).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # colibri_browser: test tooling

from engine.base.errors import ColibriError  # noqa: E402
from colibri_browser import check_page, render_png  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("html", help="the page to load")
    p.add_argument("-o", "--output", help="PNG to write (default: next to the page, .png)")
    p.add_argument("--check-only", action="store_true", help="load and check; no screenshot")
    p.add_argument("--width", type=int, default=1200)
    args = p.parse_args(argv)
    html = Path(args.html)
    try:
        if not html.is_file():
            raise ColibriError(f"{html}: no such file")
        check = check_page(html)
        print(f"{html}: {len(check.images)} image(s), {len(check.broken_images)} broken, "
              f"{len(check.errors) + len(check.console)} error(s), page height {check.height} px")
        for img in check.broken_images:
            print(f"  broken image: {img['alt']!r} ({img['width']}x{img['height']})")
        for err in check.errors + check.console:
            print(f"  {err}")
        if not args.check_only:
            out = Path(args.output) if args.output else html.with_suffix(".png")
            render_png(html, out, width=args.width, height=check.height)
            print(f"screenshot: {out}")
    except ColibriError as exc:
        print(f"render_report: error: {exc}", file=sys.stderr)
        return 2
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
