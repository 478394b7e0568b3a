"""Kiln builder: trace -> IR -> passes -> engine files, and the build-engine CLI."""
