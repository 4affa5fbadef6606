"""report.html from a stored small study (no engine run), and the page in a real browser."""

from __future__ import annotations

import base64
import csv
import io
import os
import re
import shutil
from pathlib import Path

import pytest

from report_fixture import TRIALS, make_run
from colibri import cli
from colibri_browser import check_page, find_chromium, render_png
from tuner.results.report_html import write_reports
from colibri_requirements import needs

SECTIONS = ("Hardware", "Recommended against the engine's defaults and the baseline", "Memory plan",
            "Optimization history", "Parameter importance", "Decode speed against each setting",
            "TTFT against decode speed",
            "Disk curve (probe)", "Measured speed against the bound", "Trials", "Conditions")
PLOTS = ("confirmation", "memory_plan", "history", "importance", "params", "ttft_decode", "disk_curve", "bound")
HOSTILE_NAME = "tiny<script>alert(1)</script>"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = make_run(tmp_path_factory.mktemp("report") / "run", model_name=HOSTILE_NAME)
    write_reports(run)
    return run


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"<img alt='[^']*' src='data:image/png;base64,([^']+)'>", page)]


def test_report_html_is_complete_and_self_contained(run_dir):
    page = (run_dir / "report.html").read_text()
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page, title
    images = _images(page)
    assert len(images) == len(PLOTS) == page.count("<img ")
    for png in images:
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000
    # Nothing to fetch: no URL anywhere but data: images, and a CSP that forbids the rest.
    assert not re.search(r"(src|href)=['\"](?!data:)", page)
    assert "default-src 'none'; img-src data:" in page
    # Strings from the files are data: the hostile model name is escaped, never markup.
    assert "<script>" not in page and "tiny&lt;script&gt;" in page
    # The headline carries the confirmed figures and spread of the recommended config.
    assert "427.50 tok/s</b> [384.75..470.25]" in page and "+42.5%" in page
    for name in PLOTS:
        assert (run_dir / "plots" / f"{name}.png").is_file()


def test_memory_plan_and_bound_use_the_trials_figures(run_dir):
    page = (run_dir / "report.html").read_text()
    # Memory plan table of the recommended trial: its ctx 256 x 1 KiB KV and 391 MiB runtime.
    assert re.search(r"<td[^>]*>recommended</td><td[^>]*>352.8 KiB</td><td[^>]*>256.0 KiB</td>", page)
    assert "391.0 MiB" in page and "512.0 MiB" in page
    # Bound of the recommended trial (mmap, 256 KiB, io_threads 16), by hand from the fixture:
    # disk 0.8 GB/s x buffered/direct at 1 MiB QD4 (0.8 / 1.05) = 0.610 GB/s; 38000 B/token -> 62.3 us;
    # memory (352.8 KiB dense + 4 layers x top-2 x 24 KiB) / 11.2 GB/s = 49.8 us; bound 1 / 62.3 us.
    row = re.search(r"recommended \(trial 2\)</td>(.*?)</tr>", page).group(1)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", row)
    assert cells == ["37.1 KiB", "0.610", "0.062", "0.050", "disk", "16040.10", "450.00", "3%"]


def test_trials_table_and_csv_come_from_the_same_frame(run_dir):
    page = (run_dir / "report.html").read_text()
    table = page[page.index("<table class=\"dataframe trials\">"):]
    table = table[:table.index("</table>")]
    assert table.count("<tr") == 1 + len(TRIALS) + 1  # header, feasible trials, the OOM one
    assert "killed by the cgroup OOM killer" in table
    rows = list(csv.DictReader(io.StringIO((run_dir / "trials.csv").read_text())))
    assert [r["status"] for r in rows] == ["ok"] * len(TRIALS) + ["oom_killed"]
    assert rows[-1]["feasible"] == "False" and rows[0]["feasible"] == "True"
    assert rows[2]["chunk_size"] == "262144" and rows[-1]["decode_tok_s"] == ""


def test_cli_report_and_bad_run_dir(run_dir, tmp_path, capsys):
    (run_dir / "report.html").unlink()
    assert cli.main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").is_file()
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no result.json" in err[0]
    (tmp_path / "result.json").write_text('{"schema": "colibri.tune/1", "schema": "x"}')
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "duplicate key" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "study.db").write_bytes(b"not a database")
    assert cli.main(["report", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot open the study" in err[0]


# --- in a browser ---------------------------------------------------------------------------

# CI (.ci/run) sets COLIBRI_REQUIRE_CHROMIUM: there a missing browser fails instead of skipping
# (tests/colibri_requirements.py).
needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason=needs("chromium", "chromium not installed (scripts/setup.sh installs it for CI)"))


@needs_chromium
def test_report_loads_in_chromium_with_every_image_decoded(run_dir, tmp_path):
    check = check_page(run_dir / "report.html")
    assert len(check.images) == len(PLOTS)
    assert all(i["data_uri"] and i["width"] > 100 and i["height"] > 100 for i in check.images), check.images
    assert check.errors == [] and check.console == [] and check.ok
    png = render_png(run_dir / "report.html", tmp_path / "report.png", height=check.height)
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == 1200 and height == check.height > 3000


@needs_chromium
def test_the_browser_check_sees_broken_images_and_errors(tmp_path):
    """The check must be able to fail: a corrupt image, a remote one and a script error."""
    page = tmp_path / "bad.html"
    # Its CSP blocks the remote image at once (no network wait) and lets the inline script run.
    page.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><meta http-equiv='Content-Security-Policy' "
                    "content=\"img-src data:; script-src 'unsafe-inline'\"></head><body>"
                    "<img alt='corrupt' src='data:image/png;base64,AAAA'>"
                    "<img alt='remote' src='http://192.0.2.1/x.png'>"
                    "<script>console.error('boom'); missing();</script></body></html>")
    check = check_page(page)
    assert {i["alt"] for i in check.broken_images} == {"corrupt", "remote"}
    assert any("boom" in e for e in check.errors) and any("missing" in e for e in check.errors)
    assert not check.ok


def test_report_of_a_run_where_nothing_fit(tmp_path):
    """No recommended config (every trial infeasible): the page still renders and says so."""
    import json
    run = make_run(tmp_path / "run")
    result = json.loads((run / "result.json").read_text())
    result.update(recommended=None, gain_over_baseline=None, candidates=[])
    result["baseline"]["confirmed"] = None
    (run / "result.json").write_text(json.dumps(result))
    write_reports(run)
    page = (run / "report.html").read_text()
    assert "No configuration ran within the budget" in page
    assert "<h2>Trials</h2>" in page and "killed by the cgroup OOM killer" in page
    for png in _images(page):
        assert png.startswith(b"\x89PNG")


def test_memory_plan_labels_only_segments_they_fit():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tuner.results.report_plots import _drop_overflowing

    fig, ax = plt.subplots(figsize=(8, 2))
    ax.set_xlim(0, 1)
    wide = ax.barh(0, 0.5, left=0.0)[0]
    narrow = ax.barh(0, 0.01, left=0.5)[0]
    kept = ax.text(0.25, 0, "423.6 MiB", ha="center", fontsize=7)
    dropped = ax.text(0.505, 0, "72.0 MiB", ha="center", fontsize=7)
    _drop_overflowing(fig, [(kept, wide), (dropped, narrow)])
    assert kept in ax.texts and dropped not in ax.texts
    plt.close(fig)


def test_one_word_cells_do_not_break_at_hyphens():
    from tuner.results.html_page import table
    html = table(["quant", "config"], [["int4-g64", "chunk 1.0 MiB, prefetch 0"]])
    assert "<td class='word'>int4-g64</td>" in html
    assert "<td>chunk 1.0 MiB, prefetch 0</td>" in html
