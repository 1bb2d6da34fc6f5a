"""What sparse-ft writes to disk, written so that nothing is lost (outputs.py)."""
