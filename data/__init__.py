"""Dataset preparation (prepare.py) and length-bucketed batching (loader.py) for nanogen."""
