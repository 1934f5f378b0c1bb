"""Building things once, the same way: the cache folder of built-once artefacts (embedded models, reward
stand-ins) and its atomic build routine (:mod:`.cache_folder`), and repeatable CPU builds in a child process with a
pinned numerical environment (:mod:`.repeatable`)."""
