"""Tasks: a model, its rewards' scoring and its report, packaged outside the core (the core reports whatever a
task's reward hands it: ``batch_metrics`` figures and a per-group ``report_table``)."""
