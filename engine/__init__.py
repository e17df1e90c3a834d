"""The engine beside the lesson: its scheduler, loop, API and program (docs/layout.md)."""
