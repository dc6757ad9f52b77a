"""Command-line interface: main.py holds the explicit command list."""
