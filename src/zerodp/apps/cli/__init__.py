"""Command-line interface: ``zerodp train | estimate | bench | consolidate``."""
