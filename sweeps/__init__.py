"""Offline idle-node sweeps, the Slurm health check entry, return-to-pool decisions."""
