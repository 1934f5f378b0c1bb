"""Built-in reward plugins of flowgrpo, found through the ``flowgrpo.rewards`` entry-point group."""
