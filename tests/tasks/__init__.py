"""Specifications of flowgrpo.tasks: the digits task (data, classifiers, judge, pretraining) and its learning."""
