"""`vlforge view`: the run viewer (runs.py reads run directories, app.py serves or exports the page)."""
