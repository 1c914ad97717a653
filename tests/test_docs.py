"""The documentation users read: every link resolves, every command it shows exists.

Checked over README.md, CHANGELOG.md, ARCHITECTURE.md and docs/**/*.md: relative links
(and their #anchors, by GitHub's heading slugs) name files and headings that exist;
every `ctseg SUBCOMMAND --option` in a shell code block is a real subcommand and option;
every `make TARGET` a target of the Makefile. And the README stays a front door.
"""

import re
import shlex
from pathlib import Path

import pytest
import typer
from helpers import REPO

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app

PAGES = sorted(
    [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "ARCHITECTURE.md"]
    + list((REPO / "docs").rglob("*.md"))
)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_SHELL = ("", "bash", "sh", "shell", "console")


def _ids(page: Path) -> list[str]:
    return [str(page.relative_to(REPO))]


def _without_code(text: str) -> str:
    return _FENCE.sub("", re.sub(r"`[^`\n]*`", "", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            found.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_link_resolves(page):
    broken = []
    for match in _LINK.finditer(_without_code(page.read_text())):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


def _options() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    return {
        name: {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        for name, command in group.commands.items()
    }


def _shell_lines(text: str):
    for language, body in _FENCE.findall(text):
        if language in _SHELL:
            # Continuation lines join their command; comments go.
            yield from (
                line.split(" #")[0].strip()
                for line in body.replace("\\\n", " ").splitlines()
                if line.strip() and not line.lstrip().startswith("#")
            )


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_command_shown_exists(page):
    options = _options()
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    wrong = []
    for line in _shell_lines(page.read_text()):
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part)
            except ValueError:
                words = part.split()
            while words and re.match(r"[A-Z_]+=", words[0]):  # VAR=value before a command
                words = words[1:]
            if len(words) >= 2 and words[0].endswith("ctseg") and not words[1].startswith("-"):
                command = words[1]
                if command not in options:
                    wrong.append(f"{line}: no command `ctseg {command}`")
                    continue
                for word in words[2:]:
                    flag = word.split("=")[0]
                    if flag.startswith("--") and flag not in options[command]:
                        wrong.append(f"{line}: `ctseg {command}` has no {flag}")
            elif len(words) >= 2 and words[0] == "make" and words[1] not in targets:
                wrong.append(f"{line}: no make target {words[1]}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_is_a_front_door():
    """What ctseg is, the two commands, and links: the rest lives in docs/."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    assert "make demo" in readme and "make test" in readme
    assert readme.index("make demo") < 2000  # near the top
