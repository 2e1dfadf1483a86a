"""The `tessera` script itself: supervision first (cli/stopping.py), before anything heavy is imported, then the
command (cli/main.py). Tests call cli/main.main in-process, which must not mark or sweep the test's processes."""

from __future__ import annotations

import sys


def main() -> int:
    from cli import stopping

    stopping.supervise()
    try:
        from cli.main import main as command
    except stopping.Stopped as stop:  # a stop while the command's modules load
        print(f"tessera: {stopping.stop_line(stop.signum)}", file=sys.stderr)
        return stop.exit_code
    return command()


if __name__ == "__main__":
    sys.exit(main())
