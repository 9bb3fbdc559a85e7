"""Failure tests for pgqueue: kill workers, restart the database, hold snapshots; count exactly.

``python -m benchmarks.chaos --help``; see README.md in this folder.
"""
