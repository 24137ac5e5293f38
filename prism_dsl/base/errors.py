"""User-facing errors: one exception type carrying every diagnostic of a run.

Every mistake in a user's file (syntax, names, shapes, unsound axioms, impossible parameters) becomes a
`Diagnostic` with a source location. Passes collect diagnostics and raise one `PrismError` at the end of the
pass, so a user sees all the errors of a file at once. The CLI prints `err.render()` and exits 1; nothing
else in the package prints errors (the cache warns once about a record it cannot read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Loc:
    """A position in a source file: 1-based line and column; `text` is the whole source, for context."""

    path: str
    line: int = 0
    col: int = 0
    text: str | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        path = shown_path(self.path)
        return f"{path}:{self.line}:{self.col}" if self.line else path

    def source_line(self) -> str | None:
        if not self.text or not self.line:
            return None
        lines = self.text.split("\n")  # as the parser counts lines: a U+2028 or form feed does not end one
        return lines[self.line - 1].rstrip("\r") if self.line <= len(lines) else None


def shown_path(path: str) -> str:
    """A path as a user should read it: relative to the working directory when it lies below it."""
    p = Path(path)
    if p.is_absolute():
        try:
            return str(p.relative_to(Path.cwd()))
        except (ValueError, OSError):
            pass
    return path


_WIDTH = 100
_VISIBLE = {c: 0x2400 + c for c in range(32)} | {0x7F: 0x2421}  # U+2400..: the Control Pictures block


@dataclass(frozen=True)
class Diagnostic:
    loc: Loc | None
    message: str
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        head = f"{self.loc}: {self.message}" if self.loc else self.message
        parts = [head]
        src = self.loc.source_line() if self.loc else None
        if src is not None:
            # Tabs would shift the caret; expand them the same way on both lines. Other control characters
            # (a stray CR, NUL, ESC) would move the terminal's cursor; show their symbols, one column each.
            shown = src.expandtabs(4).translate(_VISIBLE)
            caret_col = len(src[: max(self.loc.col - 1, 0)].expandtabs(4))
            if len(shown) > _WIDTH:  # show a window around the caret, not a 5000-character line
                start = max(0, min(caret_col - _WIDTH // 2, len(shown) - _WIDTH))
                shown = ("..." if start else "") + shown[start : start + _WIDTH] + "..."
                caret_col = caret_col - start + (3 if start else 0)
            parts.append("    " + shown)
            parts.append("    " + " " * caret_col + "^")
        parts.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(parts)


class PrismError(Exception):
    """Bad user input. Holds one or more diagnostics, ordered by location."""

    def __init__(self, diagnostics: Diagnostic | list[Diagnostic] | str, loc: Loc | None = None):
        if isinstance(diagnostics, str):
            diagnostics = [Diagnostic(loc, diagnostics)]
        elif isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics = sorted(diagnostics, key=_order)
        super().__init__(self.render())

    def render(self) -> str:
        text = "\n".join(d.render() for d in self.diagnostics)
        if len(self.diagnostics) > 1:
            text += f"\n{len(self.diagnostics)} errors"
        return text


def _order(d: Diagnostic) -> tuple:
    return (d.loc.path, d.loc.line, d.loc.col) if d.loc else ("", 0, 0)


class Collector:
    """Gathers diagnostics during a pass; `raise_if_any()` ends the pass with one PrismError."""

    def __init__(self) -> None:
        self.diagnostics: list[Diagnostic] = []

    def error(self, loc: Loc | None, message: str, *notes: str) -> None:
        d = Diagnostic(loc, message, tuple(dict.fromkeys(notes)))
        if d not in self.diagnostics:
            self.diagnostics.append(d)

    def extend(self, err: PrismError) -> None:
        for d in err.diagnostics:
            if d not in self.diagnostics:
                self.diagnostics.append(d)

    def __bool__(self) -> bool:
        return bool(self.diagnostics)

    def raise_if_any(self) -> None:
        if self.diagnostics:
            raise PrismError(self.diagnostics)
