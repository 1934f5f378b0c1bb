"""Conformance kits for plugin authors and the test suite: a model adapter's (:mod:`.adapters`) and a reward's
(:mod:`.rewards`). The core never imports them."""
