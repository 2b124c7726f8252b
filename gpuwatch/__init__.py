"""gpuwatch: a GPU-node daemon that tells which processes hold GPU memory and which should not."""

__version__ = "0.1.0"
