"""The README and the pages under docs/: links, anchors, the site's navigation."""
