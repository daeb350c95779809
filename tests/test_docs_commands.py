"""Issue 28 item 6: no command the README or docs/ show fails to parse, and no link of theirs leads
nowhere. Every `pdc` line in their ```bash blocks goes through the CLI's own parser
(cluster/cli.py build_parser); every relative link names a file that exists, and an anchor one of
its headings."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pdcluster.cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def bash_commands(text: str) -> list[str]:
    """The `pdc` command lines of a page's ```bash blocks (continuations joined, comments cut)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for k, word in enumerate(words):
                starts = k == 0 or words[k - 1] in ("&&", "||", ";", "|")
                if starts and (word.endswith("/pdc") or word == "pdc"):
                    end = next((j for j in range(k + 1, len(words)) if words[j] in ("&&", "|", ";")), len(words))
                    out.append(shlex.join(words[k + 1:end]))
    return out


COMMANDS = [(page.relative_to(ROOT), cmd) for page in PAGES for cmd in bash_commands(page.read_text())]


def test_the_pages_show_pdc_commands():
    assert len(COMMANDS) > 40 and {str(p) for p, _ in COMMANDS} >= {"README.md", "docs/replay.md", "docs/sim.md"}


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_every_pdc_command_shown_parses(page, command):
    try:
        build_parser().parse_args(shlex.split(command))
    except SystemExit as err:
        pytest.fail(f"{page}: `pdc {command}` does not parse (exit {err.code})")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_relative_link_leads_somewhere():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                anchors = {slug(h) for h in re.findall(r"(?m)^#+ (.*)$", file.read_text())}
                if anchor not in anchors:
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)
