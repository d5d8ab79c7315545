"""Where reqscope keeps the models it pulled: one folder, named here so loading and pulling agree.

Loading needs it too (the layout cache is written only into pulled models' folders), and the
loader must not import the downloader, so the path lives with the checkpoint code.
"""

from __future__ import annotations

from pathlib import Path

from minengine import settings

HOME_ENV = settings.HOME_ENV


def models_home() -> Path:
    """Folder that holds pulled models: `$REQSCOPE_HOME` if set, else the user cache."""
    return Path(settings.models_home().value)
