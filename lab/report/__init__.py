"""Reports of a run: frames from the store, figures, tables, and the md/html documents."""
