"""The lessons' experiments: code a lesson runs and shows only as a sketch (measurements,
side-by-side runs, pictures), kept here so the notebooks stay readable."""
