"""The router role: the id queue. loop.py is its socket loop around the pure scheduler, records, migration policy and journal."""
