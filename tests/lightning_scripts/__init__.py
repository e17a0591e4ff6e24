"""Standalone scripts that the Lightning and Fabric tests run in subprocesses."""
