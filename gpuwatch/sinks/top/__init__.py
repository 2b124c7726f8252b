"""What `gpuwatch top` renders: the lines of its view, and the documents and samples it shows.

feed.py refreshes the documents in a thread of its own (from gpuwatch.app.status: the running
daemon's, or polls of top's own) and keeps the samples of each process; view.py turns a document
and the interface's state into lines for a terminal of a given size, without curses, from the
rows of rows.py (the process trees, filtered and sorted), the lines of lines.py and the pages of
details.py. The screen that draws them, reads the keys and reaps is gpuwatch.app.top.
"""
