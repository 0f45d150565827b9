"""What a suite of runs measured: records read from each run, their statistics, the Markdown tables and the plots.

``tools/suite.py`` trains and validates the runs (orchestration: commands, processes, resume) and hands the records
to ``outputs.write_outputs``; ``tools/compare_suites.py`` puts two finished suites side by side. Modules:

* ``records``  a run's folder and TensorBoard events -> one record (the ``COLUMNS`` of results.csv); results.csv back;
* ``stats``    mean ± std over seeds, differences paired by seed with the baseline row;
* ``tables``   results.md, positions.md, frontier.md and the two-suite comparison, as Markdown;
* ``plots``    val loss against ACR, the validation curves, the frontier;
* ``outputs``  every output file of a suite at once.
"""
