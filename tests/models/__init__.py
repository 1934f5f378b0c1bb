"""Specifications of flowgrpo.models: each adapter against its diffusers pipeline, the shared conformance
suite, attention kernels, the diffusers helpers the adapters rely on."""
