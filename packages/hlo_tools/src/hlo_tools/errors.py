"""The one exception the parser raises."""


class HloParseError(ValueError):
    """Malformed HLO text. ``line_number`` is 1-based (0 when the whole text is at fault)."""

    def __init__(self, message: str, line_number: int = 0, line: str = ""):
        self.message = message
        self.line_number = line_number
        self.line = line
        where = f"line {line_number}: " if line_number else ""
        shown = f"\n    {line.strip()[:200]}" if line else ""
        super().__init__(f"{where}{message}{shown}")
