"""The dashboard's page, script and style sheet (served by corral.api.dashboard)."""
