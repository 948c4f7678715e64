"""One measurement per environment variant, each in a fresh process.

XLA reads ``XLA_FLAGS`` and PjRt its dispatch mode once, when the backend
starts, so each variant of a measurement runs as its own process.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def run_variant(command: list[str], overrides: dict[str, str], timeout: float,
                log: Path | None = None) -> tuple[int | str, str]:
    """Run ``command`` with this environment plus ``overrides``: its exit code (or ``"timed out"``)
    and its output, stdout and stderr together. With ``log``, the output streams into that file
    as it comes, so that it survives this process being stopped."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **overrides)
    if log is not None:
        with open(log, "w") as sink:
            try:
                code: int | str = subprocess.run(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                                 timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timed out"
        return code, log.read_text()
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        return done.returncode, done.stdout
    except subprocess.TimeoutExpired as exc:
        output = exc.output or ""
        return "timed out", output.decode(errors="replace") if isinstance(output, bytes) else output
