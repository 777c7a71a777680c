"""Multi-node sets: node plans, the run-folder rendezvous, the node runner, the set supervisor
(local launcher), the Slurm job writer and the node network (addresses, interfaces)."""
