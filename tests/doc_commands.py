"""The commands of a Markdown document's ```bash blocks, as bash reads them (tests/test_readme.py)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Command:
    doc: str
    line: int  # where the command starts (1-based)
    text: str  # as bash reads it: continuations joined, the trailing comment cut

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def module(self) -> str | None:
        """``specdec.decoders.bench`` for ``python -m specdec.decoders.bench ...``."""
        words = self.words
        return words[2] if words[:2] == ["python", "-m"] and len(words) > 2 else None


def strip_comment(line: str) -> str:
    """``line`` without its trailing comment: from a ``#`` outside quotes that starts a word."""
    quote, escaped = None, False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def blocks(text: str, language: str) -> list[tuple[int, list[str]]]:
    """Each fenced block of ``language``: (the line number of its first line, its lines)."""
    found, body, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if body is None and line.strip() == f"```{language}":
            body, start = [], number + 1
        elif body is not None and line.strip() == "```":
            found.append((start, body))
            body = None
        elif body is not None:
            body.append(line)
    return found


def commands_of(doc: str) -> list[Command]:
    """Every command of ``doc``'s ```bash blocks, as bash reads it."""
    commands = []
    for start, lines in blocks((ROOT / doc).read_text(), "bash"):
        pending, first, raw = "", 0, ""
        for offset, line in enumerate(lines):
            code = strip_comment(line)
            if not pending:
                first = start + offset
            raw += line + "\n"
            if code.endswith("\\"):  # continued on the next line
                pending += code[:-1]
                continue
            text = (pending + code).strip()
            if text:  # shlex, told of comments and continuations, reads the same words
                assert shlex.split(raw.replace("\\\n", ""), comments=True) == shlex.split(text), doc
                commands.append(Command(doc, first, text))
            pending, raw = "", ""
        assert not pending, f"{doc}: a block ends inside a continued command"
    return commands
