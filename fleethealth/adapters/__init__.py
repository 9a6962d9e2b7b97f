"""Scheduler adapters: Slurm and Kubernetes consumers of recommendations."""
