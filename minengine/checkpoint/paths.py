"""Where reqscope keeps the models it pulled: one folder, named here so loading and pulling agree.

Loading needs it too (the layout cache is written only into pulled models' folders), and the
loader must not import the downloader, so the path lives with the checkpoint code.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "REQSCOPE_HOME"


def models_home() -> Path:
    """Folder that holds pulled models: `$REQSCOPE_HOME` if set, else the user cache."""
    override = os.environ.get(HOME_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs  # about 10 ms: only a pull, or a CPU load deciding on its layout cache, asks

    return Path(platformdirs.user_cache_dir("reqscope")) / "models"
