"""Specifications of the core's reward infrastructure, flowgrpo.rewards: composition, background scoring, the
remote reward and its server, discovery. The reward plugins' own tests are in rewards/tests/."""
