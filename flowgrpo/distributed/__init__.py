"""Processes and their collectives: every collective with its single-process fallback (:mod:`.dist`), context
(sequence) parallelism (:mod:`.context_parallel`), and how this process was launched and is stopped
(:mod:`.launch`). Where each part of the model lives on the processes is :mod:`flowgrpo.parallel`."""
