"""An example flowgrpo reward plugin; see ``reward.py``."""

from flowgrpo_colorfulness.reward import Colorfulness, colorfulness

__all__ = ["Colorfulness", "colorfulness"]
