"""``inferd bench URL``: a load generator and report for any OpenAI-compatible server.

A pure client: nothing here imports the rest of inferd, so it measures inferd
and its peers the same way. ``config`` is light (the CLI imports it);
``main.run`` does the work.
"""
