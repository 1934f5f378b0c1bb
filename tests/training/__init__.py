"""Specifications of flowgrpo.training run end to end: resume, the report, exact ratios, devices, and the
multi-process runs (distributed, sharded), with the scripts torchrun starts (sharded_train.py,
fake_device_train.py) and the fake accelerator (fake_device.py)."""
