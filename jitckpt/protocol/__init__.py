"""What the launcher and the workers say to each other: the control channel and exit codes."""
