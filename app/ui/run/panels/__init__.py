"""The run explorer's panels, one per stage of the request."""
