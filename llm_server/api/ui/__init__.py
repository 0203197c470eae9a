"""The page for people at `/`: models, live figures, recent requests and a playground."""
