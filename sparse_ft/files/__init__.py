"""Files: what sparse-ft writes to disk, written so that nothing is lost (outputs.py), and what
it reads from a user, read strictly (json_files.py, strict.py; keyvalue.py for ``key=value``
arguments)."""
