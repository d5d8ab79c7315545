"""The weight-format comparison (`w`): the request on screen re-run in another format, side by side."""
