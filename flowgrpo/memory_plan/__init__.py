"""The memory plan behind ``flowgrpo plan CONFIG --gpus N``: per-GPU and per-rank host memory of a training config,
computed without allocating anything (:mod:`.estimate`), from the released model families' size tables
(:mod:`.families`)."""
