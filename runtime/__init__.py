"""Kiln runtime: loads engines and serves requests."""
