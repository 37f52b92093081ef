"""A benchmark-and-tuning laboratory for LLM serving engines. Its interface is the `lab` command
(lab/cli.py). The packages, from the bottom up:

- `engine/`: the bundled engine, a separate program the lab talks to over HTTP only;
- `store/`: the database: the records written, the writer, the readers; nothing else of lab;
- `instruments/`: measurements over HTTP, with a read-only view of the store;
- `ladder/`: the ladder file, its validation and the plan of boots;
- `analysis/`: statistics, the KEEP rule, verdicts and comparisons from stored cells;
- `report/`: reports, exports and console views of stored runs;
- `runner/`: booting engines and running a ladder's slots (run, calibrate, sweep, serve --best);
- `tune/`: `lab tune`, whose trials are runner boots.

tests/test_boundaries.py enforces the rules that keep them apart.
"""
