"""`colibri report`, `colibri profile` and `colibri compare`: what a tune run leaves, read back."""

from __future__ import annotations

import sys

from engine.api import file_target, format_size, in_place_files
from colibri.commands.argtypes import add_output_option
from tuner.results.printers import print_json as _print_json
from tuner.results.report_html import write_reports
from tuner.share import profiles
from tuner.share.compare import compare, format_text


def add_report(sub) -> None:
    p = sub.add_parser("report", help="(re)write a tune run's report.md and self-contained report.html")
    add_output_option(p, "run_dir", kind="in place", metavar="RUN_DIR",
                      help="a `colibri tune` run directory (report.md, report.html and plots/ are written in it)")
    p.add_argument("--storage", help="the study's storage URL when it is not the run's study.db (PostgreSQL)")
    p.add_argument("--open", action="store_true", help="open report.html in the default browser")
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    p.set_defaults(func=cmd_report)


# What `report` (re)writes in the run directory (tuner/results/report_md.py, report_html.py).
REPORT_FILES = {"report.md": "file", "report.html": "file", "plots": "dir"}


def cmd_report(args) -> int:
    in_place_files(args.run_dir, REPORT_FILES, command="report", flag="RUN_DIR")
    files = write_reports(args.run_dir, storage=args.storage)
    if args.json:
        _print_json({k: str(v) for k, v in files.items()})
    else:
        print(f"report.md: {files['report.md']}\nreport.html: {files['report.html']}")
    if args.open:
        import webbrowser
        if not webbrowser.open(files["report.html"].resolve().as_uri()):
            print(f"colibri report: no browser to open; the page is {files['report.html']}", file=sys.stderr)
    return 0


def add_profile(sub) -> None:
    p = sub.add_parser("profile", help="shareable hardware profiles: export, import, list, show, diff")
    ps = p.add_subparsers(dest="action", metavar="ACTION")
    ps.required = True
    e = ps.add_parser("export", help="a run directory or probe JSON → a shareable profile (no identity)")
    e.add_argument("source", metavar="RUN_DIR|PROBE_JSON")
    add_output_option(e, "-o", "--output", kind="file", metavar="FILE", help="write here (default: print it)")
    e.add_argument("--include-identity", action="store_true",
                   help="keep the hostname, user name and model paths (for your own records)")
    i = ps.add_parser("import", help="validate a profile and copy it into the local store")
    i.add_argument("file", metavar="FILE")
    add_output_option(i, "--name", kind="file", help="store name (default: <cpu>-<disk>-<fingerprint>); "
                                                      "writes <store>/NAME.json")
    i.add_argument("--force", action="store_true", help="replace a different profile of the same name")
    ps.add_parser("list", help="the profiles in the local store")
    s = ps.add_parser("show", help="one profile: hardware and best configs")
    s.add_argument("ref", metavar="NAME|FILE")
    d = ps.add_parser("diff", help="two profiles: hardware differences, best configs side by side")
    d.add_argument("a", metavar="A")
    d.add_argument("b", metavar="B")
    for q in (e, i, s, d, ps.choices["list"]):
        q.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    if args.action == "export":
        output = file_target(args.output, command="profile export", recognise=profiles.PROFILE_FILE,
                             sources=[args.source]) if args.output is not None else None
        data = profiles.export_profile(args.source, include_identity=args.include_identity)
        if output:
            profiles.write_profile_file(data, output)
            print(f"profile written to {args.output} ({len(data['best_configs'])} best config(s)"
                  + (", WITH identity" if args.include_identity else "") + ")", file=sys.stderr)
        if args.json or not args.output:
            _print_json(data)
    elif args.action == "import":
        name, path, changed = profiles.import_profile(args.file, name=args.name, force=args.force)
        if args.json:
            _print_json({"name": name, "path": str(path), "changed": changed})
        else:
            print(f"{'imported' if changed else 'already in the store:'} {name} ({path})")
    elif args.action == "list":
        rows = profiles.list_profiles()
        if args.json:
            _print_json(rows)
        elif not rows:
            print(f"no profiles in {profiles.store_dir()} (colibri profile import FILE)")
        for r in [] if args.json else rows:
            print(f"{r['name']}: invalid ({r['error']})" if "error" in r else
                  f"{r['name']:<44} {r['cpu'][:32]:<32} {r['cores']:>3} cores {format_size(r['ram_bytes']):>9} "
                  f"{r['disk']:<16} {r['configs']} config(s)  {r['created_utc']}")
    elif args.action == "show":
        label, data = profiles.resolve(args.ref)
        if args.json:
            _print_json(data)
        else:
            print(profiles.format_show(label, data))
    else:
        d = profiles.diff(profiles.resolve(args.a), profiles.resolve(args.b))
        if args.json:
            _print_json(d)
        else:
            print(profiles.format_diff(d))
    return 0


def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="tune runs and/or profiles side by side (markdown, HTML, plots)")
    p.add_argument("inputs", nargs="+", metavar="RUN_DIR|PROFILE", help="run directories, profile files or "
                                                                         "names in the local store")
    add_output_option(p, "--out", kind="directory", metavar="DIR", help="where to write (default: reports/compare-<time>)")
    p.add_argument("--force", action="store_true", help="compare even when the conditions differ "
                                                        "(model, budget, cold/warm, tokens, tool version)")
    p.add_argument("--model", metavar="NAME|HASH", help="from profiles, only the entries of this model "
                                                        "(name, or geometry hash prefix)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    summary = compare(args.inputs, out_dir=args.out, force=args.force, model=args.model)
    if args.json:
        _print_json(summary)
    else:
        print(format_text(summary))
    return 0
