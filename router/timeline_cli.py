"""`pdc timeline ...`: look at a recorded run directory (summary, one request, Perfetto, HTML).

`add_timeline_commands(subparsers)` adds the commands to an existing `pdc`
parser; each sets `fn`, which the caller runs as `args.fn(args)`. A bad run
directory or request id is a user error: one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from pdcluster.router.run_store import Run, load_run


def _fail(message: str) -> None:
    print(f"pdc timeline: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _guarded(fn: Callable[[argparse.Namespace, Run], None]) -> Callable[[argparse.Namespace], None]:
    def run(a: argparse.Namespace) -> None:
        try:
            fn(a, load_run(a.run))
        except KeyError as err:  # str(KeyError) would quote the message
            _fail(str(err.args[0]) if err.args else "unknown key")
        except BrokenPipeError:
            raise  # the reader went away (| head): pdc's main stops quietly
        except (OSError, ValueError) as err:  # missing/unreadable run dir, corrupt records, unwritable output
            _fail(str(err))

    return run


def _window(a: argparse.Namespace, run: Run) -> Run:
    """The requests `--phase` and `--between` pick (router/timeline_window.py); says which."""
    return _window_and_line(a, run)[0]


def _window_and_line(a: argparse.Namespace, run: Run) -> tuple[Run, str]:
    from pdcluster.router.timeline_window import parse_between, select

    picked, line = select(run, a.phase, parse_between(a.between) if a.between else None, a.replay)
    print(line, file=sys.stderr if a.timeline_cmd in ("export", "report") else sys.stdout)
    if not picked.records:
        _fail(f"no request of run {run.meta.run_id} in that window ({line.removeprefix('window: ')})")
    return picked, line


def _summary(a: argparse.Namespace, run: Run) -> None:
    from pdcluster.router.timeline_views import format_summary, summarize

    print(format_summary(summarize(_window(a, run))))


MIN_WIDTH = 52


def _out(path: Path) -> Path:
    """An output file's path, its folder made (as every --out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _show(a: argparse.Namespace, run: Run) -> None:
    from pdcluster.router.attribution import attribute
    from pdcluster.router.timeline_views import format_waterfall

    if a.width is not None and a.width < MIN_WIDTH:
        _fail(f"--width {a.width}: at least {MIN_WIDTH} characters (the phase, where and times take 42)")
    request_id = a.request_id
    if request_id is None:  # the window's slowest first token
        picked = _window(a, run)
        ttfts = ((attribute(r).ttft_ns, r.request_id) for r in picked.records)
        timed = [(ns, rid) for ns, rid in ttfts if ns is not None]
        if not timed:
            _fail(f"no request of run {run.meta.run_id} in that window reached its first token: name one")
        request_id = max(timed)[1]
        print(f"the slowest first token in the window: {request_id}")
    width = a.width or shutil.get_terminal_size((100, 24)).columns  # the bars use what the terminal has
    print(format_waterfall(run, request_id, width=width))


def _export(a: argparse.Namespace, run: Run) -> None:
    from pdcluster.router.perfetto import write_trace

    print(write_trace(_window(a, run), _out(a.out or Path(a.run) / "trace.json")))


def _report(a: argparse.Namespace, run: Run) -> None:
    from pdcluster.router.report import write_report

    picked, line = _window_and_line(a, run)
    print(write_report(picked, _out(a.out or Path(a.run) / "report.html"), line))


def _window_flags(p: argparse.ArgumentParser) -> None:
    from pdcluster.router.timeline_window import CHOICES

    p.add_argument("--phase", choices=CHOICES, default="auto",
                   help="a replay's phase to look at (default auto: the formal window if the run has one, "
                        "else every request; all: every request)")
    p.add_argument("--between", metavar="A,B", help="only requests that arrived A to B seconds after the first")
    p.add_argument("--replay", default="last", help="of a run that served several replays, whose phase: last "
                                                    "(default), all, or one by name (bench-<token>, sim)")


def add_timeline_commands(subparsers: argparse._SubParsersAction) -> None:
    tl = subparsers.add_parser("timeline", help="where the time of a recorded run went (TTFT attribution)")
    sub = tl.add_subparsers(dest="timeline_cmd", required=True)
    p = sub.add_parser("summary", help="per-phase TTFT split, ITL, cache hits, failures")
    p.add_argument("run", help="run directory (meta.json + requests.jsonl)")
    _window_flags(p)
    p.set_defaults(fn=_guarded(_summary))
    p = sub.add_parser("show", help="one request's waterfall (default: the window's slowest first token)")
    p.add_argument("run", help="run directory")
    p.add_argument("request_id", nargs="?", help="the request (default: the slowest TTFT in --phase's window)")
    _window_flags(p)
    p.add_argument("--width", type=int, default=None, help="line width in characters (default: the terminal's)")
    p.set_defaults(fn=_guarded(_show))
    p = sub.add_parser("export", help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    p.add_argument("run", help="run directory")
    p.add_argument("--format", choices=["perfetto"], default="perfetto")
    p.add_argument("-o", "--out", type=Path, default=None, help="output file (default RUN/trace.json)")
    _window_flags(p)
    p.set_defaults(fn=_guarded(_export))
    p = sub.add_parser("report", help="write a self-contained HTML report")
    p.add_argument("run", help="run directory")
    p.add_argument("-o", "--out", type=Path, default=None, help="output file (default RUN/report.html)")
    _window_flags(p)
    p.set_defaults(fn=_guarded(_report))
