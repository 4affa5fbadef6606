"""Headless Chromium over a local HTML page: does it load cleanly, and what does it look like.

`check_page` loads a copy of the page with one checking script added (its Content-Security-
Policy extended by that script's nonce only; images stay `data:`-only, so a page that tried to
fetch an image would show it as broken). After the load event and a settle time, the script
writes into the DOM: every <img> with its decoded natural size, every error event, every
console.error call and every CSP violation. Chromium's --dump-dom hands that DOM back, and
its own stderr console lines are scanned as a second witness. `render_png` takes a screenshot
of the whole page (height measured by the same check).

Flags: Chromium refuses to run as root without --no-sandbox; the rest keep a headless run
from touching the network or a profile (a new temporary user-data-dir each time).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.errors import ColibriError

BASE_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--hide-scrollbars", "--mute-audio")
WIDTH = 1200
TIMEOUT_S = 120
MARK = "colibri-page-check"
CONSOLE_ERROR_WORDS = ("Uncaught", "Refused to", "Failed to load", "Not allowed to load")

_CHECK_SCRIPT = """
(function(){
  var errors = [];
  window.addEventListener('error', function(e){ errors.push('error: ' + (e.message || (e.target && e.target.src
      ? 'resource failed ' + String(e.target.src).slice(0, 80) : 'unknown'))); }, true);
  document.addEventListener('securitypolicyviolation', function(e){
      errors.push('csp: ' + e.violatedDirective + ' blocked ' + String(e.blockedURI).slice(0, 80)); });
  var origError = console.error;
  console.error = function(){ errors.push('console.error: ' + Array.prototype.join.call(arguments, ' '));
      return origError.apply(console, arguments); };
  window.addEventListener('load', function(){ setTimeout(function(){
    var imgs = Array.prototype.map.call(document.images, function(img){
      return {alt: img.alt, complete: img.complete, width: img.naturalWidth, height: img.naturalHeight,
              data_uri: img.src.slice(0, 5) === 'data:'}; });
    var out = document.createElement('pre');
    out.id = '%s';
    out.textContent = JSON.stringify({images: imgs, errors: errors,
        height: Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)});
    document.body.appendChild(out);
  }, 500); });
})();
""" % MARK


class BrowserError(ColibriError):
    pass


@dataclass
class PageCheck:
    images: list[dict]
    errors: list[str]
    height: int
    console: list[str] = field(default_factory=list)

    @property
    def broken_images(self) -> list[dict]:
        return [i for i in self.images if not (i["complete"] and i["width"] > 0 and i["height"] > 0)]

    @property
    def ok(self) -> bool:
        return not self.broken_images and not self.errors and not self.console


def find_chromium() -> str | None:
    for name in (os.environ.get("COLIBRI_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def check_page(html_path: str | Path, chromium: str | None = None) -> PageCheck:
    html_path = Path(html_path).resolve()
    page = html_path.read_text(encoding="utf-8")
    nonce = secrets.token_hex(12)
    checked = _with_checker(page, nonce)
    with tempfile.TemporaryDirectory(prefix="colibri-browser-") as tmp:
        copy = Path(tmp) / "page.html"
        copy.write_text(checked, encoding="utf-8")
        out = _run(chromium, ["--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000",
                              "--dump-dom", copy.as_uri()], tmp)
    m = re.search(rf'<pre id="{MARK}">(.*?)</pre>', out.stdout, re.S)
    if not m:
        raise BrowserError(f"{html_path}: the page never finished loading in Chromium")
    import html as _html
    data = json.loads(_html.unescape(m.group(1)))
    # Chromium logs every console message at INFO; the errors are told apart by their words.
    console = [line for line in out.stderr.splitlines()
               if ":CONSOLE" in line and any(w in line for w in CONSOLE_ERROR_WORDS)]
    return PageCheck(images=data["images"], errors=data["errors"], height=int(data["height"]), console=console)


def render_png(html_path: str | Path, png_path: str | Path, chromium: str | None = None,
               width: int = WIDTH, height: int | None = None) -> Path:
    """Screenshot of the whole page (its measured height unless given) at `width` CSS pixels."""
    html_path, png_path = Path(html_path).resolve(), Path(png_path).resolve()
    if height is None:
        height = check_page(html_path, chromium).height
    with tempfile.TemporaryDirectory(prefix="colibri-browser-") as tmp:
        shot = Path(tmp) / "shot.png"
        _run(chromium, [f"--window-size={width},{max(200, min(height, 30000))}", f"--screenshot={shot}",
                        html_path.as_uri()], tmp)
        if not shot.is_file():
            raise BrowserError(f"{html_path}: Chromium wrote no screenshot")
        png_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(shot), png_path)
    return png_path


def _with_checker(page: str, nonce: str) -> str:
    csp = re.search(r'http-equiv=.Content-Security-Policy. content="([^"]*)"', page)
    if csp:
        page = page.replace(csp.group(0), csp.group(0).replace(csp.group(1), csp.group(1)
                                                               + f"; script-src 'nonce-{nonce}'"))
    tag = f"<script nonce='{nonce}'>{_CHECK_SCRIPT}</script>"
    # First thing in <head>: the listeners must exist before any image starts decoding.
    return page.replace("<head>", "<head>" + tag, 1) if "<head>" in page else tag + page


def _run(chromium: str | None, args: list[str], tmp: str) -> subprocess.CompletedProcess:
    exe = chromium or find_chromium()
    if not exe:
        raise BrowserError("chromium is not installed (apt-get install chromium, or set COLIBRI_CHROMIUM)")
    profile = tempfile.mkdtemp(prefix="profile-", dir=tmp)
    cmd = [exe, *BASE_FLAGS, f"--user-data-dir={profile}", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise BrowserError(f"chromium did not finish within {TIMEOUT_S} s") from None
