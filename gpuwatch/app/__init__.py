"""The application layer: what each command does, wired from the layers below it.

`status` gets a status document (the running daemon's, or a poll -> assess -> document of the
command's own); `reaping` is the one orchestration of a reap (plan -> confirm -> execute -> NVML
check -> audit) for `gpuwatch reap`, `top` and the daemon's auto-reap; `run` is `gpuwatch run`'s
command line and wiring; `top` is top's screen, the part of `gpuwatch top` that reads keys and
acts. Sources read, detectors judge, sinks render and actions act; only this layer (with the
daemon, doctor and demo programs above it) puts them together.
"""
