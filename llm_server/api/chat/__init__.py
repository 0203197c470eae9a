"""The one chat path every chat-shaped API shares: the request's tools, its plan, its run."""
