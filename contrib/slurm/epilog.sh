#!/bin/sh
# /etc/slurm/epilog.d/gpuwatch: free what the job left on its GPUs before the next one lands.
gpuwatch reap --job "$SLURM_JOB_ID" --kind orphan --kind leftover --kind zombie --kind stalled --yes --grace 10
case $? in
  0|3) exit 0 ;;   # no GPU memory of the job is held any more, or nothing to do
  4)   # GPU memory of the job is still held: keep the next job off this node
       scontrol update nodename="$(hostname -s)" state=drain reason="gpuwatch: GPU memory not freed"
       exit 0 ;;
  5)   exit 0 ;;   # findings named a service's processes (a raylet's, a kernel): refused, in reap.jsonl
  *)   exit 0 ;;   # gpuwatch itself failed: never fail the epilog over it
esac
