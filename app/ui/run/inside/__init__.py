"""Inside the step on screen: which step's attention and lens are shown, what to capture for them, the focus."""
