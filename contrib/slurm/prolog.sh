#!/bin/sh
# /etc/slurm/prolog.d/gpuwatch: before a job starts, free GPU memory that orphans and zombies of
# earlier jobs still hold (an epilog that did not run, or one that ran before they were found).
gpuwatch reap --kind orphan --kind zombie --yes --grace 10
case $? in
  0|3) exit 0 ;;   # nothing stale holds GPU memory any more, or nothing to do
  4)   # GPU memory is still held: a non-zero prolog makes Slurm drain the node and requeue
       # the job, instead of starting it on GPUs it would run out of memory on
       echo "gpuwatch: GPU memory of earlier jobs not freed on $(hostname -s)" >&2
       exit 1 ;;
  *)   exit 0 ;;   # gpuwatch itself failed: never hold a job back over it
esac
