"""Built-in launchers: multiprocessing (``mp``) and Ray actors (``ray``)."""
