"""Command-line entry point: ``hybridl <command> [options]``.

Each command lives in its own module with a ``main(argv) -> int`` function, imported only
when the command is used, so ``hybridl hw`` does not pay for importing the training stack.

Commands:
    train    train a model (default: LeNet on the Digits data that ship with scikit-learn)
    trace    record a few training steps with the profiler and write a Chrome trace
    hw       probe and measure this machine (bandwidth, latency, caches, GEMM, storage)
    export   export a trained model to graph JSON + safetensors (and ONNX)
    launch   run a command under mpiexec (multi-process training)
"""
import importlib
import sys

COMMANDS = {
    "train": ("hybridl.train_cli", "train a model (LeNet on Digits by default)"),
    "trace": ("hybridl.trace_cli", "record training steps with the profiler"),
    "hw": ("hybridl.hardware.report", "probe and measure this machine"),
    "export": ("hybridl.train_cli", "export a model (graph JSON + safetensors)"),
    "launch": ("hybridl.distributed.launch", "run a command under mpiexec"),
}


def _usage():
    lines = ["usage: hybridl <command> [options]", "", "commands:"]
    for name, (_, help_) in COMMANDS.items():
        lines.append(f"  {name:<8} {help_}")
    lines.append("")
    lines.append("Run `hybridl <command> --help` for a command's options; "
                 "`hybridl --version` for the version.")
    return "\n".join(lines)


def _drain():
    """Run what the command left pushed (a usage error can leave a tiny op queued, e.g. the
    RNG's seeding), so that the exit has nothing to cancel or report: the command has
    reported its own outcome."""
    import sys as _sys
    eng = _sys.modules.get("hybridl.engine")
    if eng is not None:
        try:
            eng.waitall()
        except Exception:  # noqa: BLE001 - the command's errors are its own to report
            pass


def _default_sigint():
    """After a first Ctrl-C: a second one ends the process at once (the default action, no
    traceback from wherever it lands while the program is leaving)."""
    import signal
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if _TERMINATED:                # likewise a second SIGTERM
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:                 # not the main thread: leave it
        pass


_TERMINATED = []


def _sigterm_as_interrupt():
    """SIGTERM (``kill``, ``timeout``, a batch system ending the job) stops a command as
    Ctrl-C does, through the same clean-up (temporary files of downloads and ``--save``
    removed, queued work dropped), then exits 143 (128 + SIGTERM); its default action ended
    the process at once and left them behind."""
    import signal

    def handler(signum, frame):
        _TERMINATED.append(signum)
        raise KeyboardInterrupt
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:                 # not the main thread (main() called from a thread)
        pass


def main(argv=None):
    """Dispatch ``hybridl <command>``; returns the process exit code (2 for bad usage, 130
    after Ctrl-C, 143 after SIGTERM)."""
    as_program, argv = argv is None, list(sys.argv[1:] if argv is None else argv)
    if not argv:                         # no command: usage on stderr, exit 2 (as argparse)
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"hybridl {version('hybridl')}")
        except PackageNotFoundError:            # run from a source tree, not installed
            from . import __version__
            print(f"hybridl {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"hybridl: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if as_program:                     # the program's entry point (not a call from Python)
        _sigterm_as_interrupt()
    try:                               # (the command's imports too: a Ctrl-C there)
        module = importlib.import_module(COMMANDS[cmd][0])
        entry = getattr(module, f"main_{cmd}", None) or module.main
        rc = entry(rest)
        _drain()
        return rc
    except KeyboardInterrupt:          # Ctrl-C: one line, not a traceback (files are written
        _default_sigint()              # atomically: none is half-written); 128 + SIGINT
        from . import engine           # the queued work is dropped at exit, without the
        engine.interrupted()           # 2 s grace or a note (the user asked to stop)
        if _TERMINATED:
            print(f"\nhybridl {cmd}: terminated (SIGTERM)", file=sys.stderr)
            return 143
        print(f"\nhybridl {cmd}: interrupted", file=sys.stderr)
        return 130                     # (as shell tools)
    except BrokenPipeError:            # `hybridl trace | head`: the reader left; stop quietly
        import os
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141                     # 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
