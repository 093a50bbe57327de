"""The command-line commands' argument parser: a usage error is one short line naming the
problem and a pointer to ``--help`` (exit code 2), the same for every ``hybridl`` command,
instead of argparse's usage block."""
import argparse
import sys

__all__ = ["Parser", "usage_error"]


def usage_error(prog, message):
    """Print ``prog: error: message`` and the pointer to ``prog --help`` on stderr; returns 2
    (the exit code of a usage error)."""
    # one write: under mpiexec the ranks' messages would otherwise interleave mid-line
    sys.stderr.write(f"{prog}: error: {message}\n(the options: {prog} --help)\n")
    sys.stderr.flush()
    return 2


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are :func:`usage_error`'s (exit code 2)."""

    def error(self, message):
        usage_error(self.prog, message)
        self.exit(2)
