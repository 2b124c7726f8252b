"""The commands of `gpuwatch`, one module each, as the command line lists them.

Each module owns its command: its options (click), the call into the application layer, the
render (text or JSON) and the exit code, named in `exit_codes.ExitCode`. A command that cannot go
on says why with a `CommandError`, which gpuwatch.cli's `main` prints and exits with; gpuwatch.cli
itself only wires the commands into the `gpuwatch` group. Everything a command needs beyond click
is imported when it runs: `gpuwatch status` with a daemon running is a socket read and a render.
"""
