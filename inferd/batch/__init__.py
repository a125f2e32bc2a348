"""Batch inference: the OpenAI batch file format, offline (``inferd batch``) and online (the Batch API)."""
