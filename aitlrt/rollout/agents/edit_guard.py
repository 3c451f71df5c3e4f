"""Where an agent may write: inside its repository, never under ``.git``. Shared by every agent.

``refusal(root, path)`` says why a path an agent's answer names may not be written (outside the repository once
resolved, symlinks followed, or naming ``.git`` on the way, in any case), or None. ``install_in_aider()`` makes
Aider refuse such edits, which under ``--yes-always`` it would otherwise apply (``pkg/../.git/config``, an absolute
path): its check before any edit (``Coder.allowed_to_edit``) and its one writer of edited files
(``InputOutput.write_text``, which also writes the targets of its patch format's moves) both refuse them.

This module runs inside Aider's own virtualenv too, so it imports nothing of ours. Run as
``python edit_guard.py ARGS`` it is Aider's command line with the guard installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def refusal(root: str | os.PathLike, path: str | os.PathLike) -> str | None:
    """Why an agent may not write ``path`` (relative to ``root``, or absolute), or None when it may."""
    raw = Path(path)
    if any(part.lower() == ".git" for part in raw.parts):
        return "it is under .git"
    top = Path(root).resolve()
    target = (top / raw).resolve()
    if target == top or not target.is_relative_to(top):
        return "it is outside the repository"
    if any(part.lower() == ".git" for part in target.relative_to(top).parts):
        return "it is under .git"
    return None


def install_in_aider() -> None:
    """Make Aider (imported from its venv) refuse edits that ``refusal`` forbids; the model is told why."""
    from aider.coders.base_coder import Coder
    from aider.io import InputOutput

    allowed_to_edit, write_text = Coder.allowed_to_edit, InputOutput.write_text

    def guarded_allowed_to_edit(self, path):
        why = refusal(self.root, path)
        if why:
            self.io.tool_error(f"Refusing edits to {path}: {why}.")
            return None
        return allowed_to_edit(self, path)

    def guarded_write_text(self, filename, content, *args, **kwargs):
        why = refusal(os.getcwd(), filename)
        if why:  # Aider reports a ValueError from an edit back to the model
            raise ValueError(f"Refusing to write {filename}: {why}.")
        return write_text(self, filename, content, *args, **kwargs)

    Coder.allowed_to_edit = guarded_allowed_to_edit
    InputOutput.write_text = guarded_write_text


def main() -> int:
    # This file's folder holds our aider.py: it must not shadow the real package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    install_in_aider()
    from aider.main import main as aider_main

    code = aider_main()
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
