"""The data paths, one object per path and role, chosen once at set-up: one-sided READ
(``read_producer``, ``read_consumer``), its replays (``replay``) and push (``push``)."""
